// The bf16 instantiation of the tensor-core backward's launch (attention_bwd_wmma_launch.cuh).
#include "attention_bwd_wmma_launch.cuh"

template cudaError_t attn_ext::cuda::detail::launch_cross_attention_bwd_wmma<__nv_bfloat16>(
    const attn_ext::cuda::CrossAttentionBwdParams&, const attn_ext::cuda::CrossAttentionBwdPlan&, cudaStream_t);
