"""The MoE block's seams: gating policies and router, dispatch / combine, experts, expert placement."""
