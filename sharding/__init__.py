"""tnlg.sharding: the ZeRO engine on torch.distributed (knows nothing about GPT).

The engine (stages 0-3, offload, fused kernels) lands here; see DESIGN.md's module map.
"""

__all__: list[str] = []
