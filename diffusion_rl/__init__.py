"""kinema RL core: credit machinery and flow objectives, pure torch. Kept light: import submodules directly.

- `diffusion_rl.data`: the Episode contract (numpy only).
- `batching`: Episodes -> padded transition batches with credit masks.
- `credit`: intervention-aware credit and HELP segment labels.
- `habc`: the HABC critic, one-step advantages, gate and actor weights.
- `success_model`: eVTA_0/RLER success-probability rewards, calibration metrics.
- `advantages`: GRPO, MC-GRPO, GDPO, DARA, VideoAWR energies, GAE.
- `flow`: the flow-matching module (time convention, losses, NFT, AWR, samplers, Flow-SDE, PPO).
- `distill`: DMD, Stream-R1, AFD and OPSD targets.
- `protocol`: `FlowPolicy`, what a model exposes to the core.
- `toy`: a bimodal toy flow model for tests and benchmarks.
"""
