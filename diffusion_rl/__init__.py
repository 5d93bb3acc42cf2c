"""kinema RL core: credit machinery and flow objectives, pure torch. Kept light: import submodules directly."""
