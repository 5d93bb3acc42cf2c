"""`kinema train` and `kinema eval`: the policy workflow in simulation (VLA or video policy, `policy.type`)."""
