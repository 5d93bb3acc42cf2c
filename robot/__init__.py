"""kinema's ROS 2 bridge: transports, messages, the policy node, the safety layer and the sim-robot node."""

import os

# Before the first `import mujoco` (robot.kinematics, robot.sim_robot): render offscreen through EGL, as sim/ does.
os.environ.setdefault("MUJOCO_GL", "egl")
