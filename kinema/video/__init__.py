"""`kinema video`: post-training video generators (VideoAWR, NFT, distillation, AFD, OPSD, Flow-GRPO)."""
