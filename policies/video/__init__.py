"""Video generators: diffusers video flow models wrapped for the RL core, and their rewards."""
