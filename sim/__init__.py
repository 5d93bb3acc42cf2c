"""kinema's MuJoCo tabletop tasks, scripted experts, simulated interventions and vectorised rollouts. No torch."""

import os

# Must precede the first `import mujoco`: offscreen rendering through EGL (Mesa here), not GLFW.
os.environ.setdefault("MUJOCO_GL", "egl")
