"""The attention kernels' spill tables, one module per Triton minor version (``triton_3_9``: Triton 3.9.x), each
written by ``bench/gpu/spill_table.py`` from that Triton's ahead-of-time compile and read by
:mod:`attn_ext.ops.attention.triton_spills`. A Triton without a module here gets no spill pruning."""
