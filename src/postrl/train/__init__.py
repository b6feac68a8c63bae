"""The Train Worker: the policy update (:mod:`postrl.train.worker`), its proximal policies, its
forwards, FSDP2 ranks, LoRA, the critic, DPO, and the optimizer. Nothing is imported here: a rank's
process imports only what it builds."""
