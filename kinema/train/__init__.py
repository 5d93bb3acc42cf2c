"""`kinema train` and `kinema eval`: the VLA workflow in simulation."""
