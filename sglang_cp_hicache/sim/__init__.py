"""Multi-rank CP HiCache simulator (torch.distributed, gloo)."""
