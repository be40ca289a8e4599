// ggml_sfi_flash_attn_evidence (see ggml-sfi.h) on CUDA, for a decode step's few query rows per KV head
// (n_q = n_gqa*n_tokens <= NQ <= 8), keys and values of one type T (F16, Q8_0 or Q4_0), in three kernels per chunk of
// (head, stream) pairs:
//   partial:  the keys read by the warp score loop (sfi-common.cuh, ggml_sfi_evidence's: a warp 32/NQ cells at a
//             time, each lane D/32 elements of a row), and each cell's value row; a block takes every gridDim.y-th
//             tile of 256 cells (a few parts per pair keep the combine short: merging one part per tile took as long
//             as the attention), each warp keeps per query row a running max, sum and output over its cells (every
//             lane the same max and sum, and its D/32 elements of the output), the block merges its warps' and
//             writes that part, the scores and the key norms
//   combine:  per query row, the blocks' parts merged into the output, and the row's max and sum^-alpha
//   evidence: per cell, ggml_sfi_evidence's last kernel (ggml_cuda_sfi_evidence_sum)

#include "sfi-flash-attn-evidence.cuh"

#include "sfi-common.cuh"
#include "sfi-evidence.cuh"

template <int D, int NQ, ggml_type T>
static __global__ void __launch_bounds__(SFI_WARP_BLOCK_THREADS) sfi_fae_partial(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ v, const char * __restrict__ mask,
        float * __restrict__ scores, float2 * __restrict__ parts, float * __restrict__ part_out, float * __restrict__ kn,
        const int n_q, const int n_tokens, const int n_gqa, const int n_kv, const int n_head_kv, const int b0, const int nm,
        const float s_scale, const float softcap,
        const size_t nbq1, const size_t nbq2, const size_t nbq3,
        const size_t nbk1, const size_t nbk2, const size_t nbk3,
        const size_t nbv1, const size_t nbv2, const size_t nbv3,
        const size_t nbm1, const size_t nbm3) {
    constexpr int E   = D/WARP_SIZE;
    constexpr int CPI = WARP_SIZE/NQ;
    constexpr int N_WARPS = SFI_WARP_BLOCK_THREADS/WARP_SIZE;
    constexpr int CELLS_PER_WARP = SFI_CELLS_PER_BLOCK/N_WARPS;
    static_assert(CELLS_PER_WARP % CPI == 0, "a warp's cells come in whole iterations");

    const int h    = blockIdx.x;
    const int part = blockIdx.y;
    const int bl   = blockIdx.z;
    const int b    = b0 + bl;

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    // the lane's elements of each query row, scaled (row j = g*n_tokens + t: query head h*n_gqa + g at token t), and
    // rounded as ggml_sfi_evidence rounds them (its scores, and those of flash attention's products)
    float qr[NQ][E];
    float qd[NQ];
    sfi_warp_query_rows<T, E, NQ>(qr, qd, n_q, lane, [&](const int j, const int i) {
        const char * qj = q + (j % n_tokens)*nbq1 + (h*n_gqa + j/n_tokens)*nbq2 + b*nbq3;
        return s_scale*((const float *) qj)[i];
    });

    const size_t pair = (size_t) bl*n_head_kv + h;

    float * s_out = scores + pair*n_q*n_kv;
    const char * k_base = k + h*nbk2 + b*nbk3 + sfi_lane_kv<T, E>::lane_offset(lane);
    const char * v_base = v + h*nbv2 + b*nbv3 + sfi_lane_kv<T, E>::lane_offset(lane);
    const char * m_base = mask + (b % nm)*nbm3;

    __shared__ float p_s[N_WARPS][WARP_SIZE]; // the iteration's weights, [cell][row]

    float m_run[NQ];   // per row, the same in every lane
    float s_run[NQ];
    float o_run[NQ][E];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        m_run[j] = -INFINITY;
        s_run[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o_run[j][e] = 0.0f;
        }
    }
    float m_mine = -INFINITY; // m_run[lane % NQ], the row of the lane's score

    for (int tile = part; tile*SFI_CELLS_PER_BLOCK < n_kv; tile += gridDim.y) {
        const int c_warp = tile*SFI_CELLS_PER_BLOCK + warp*CELLS_PER_WARP;

        for (int it = 0; it < CELLS_PER_WARP; it += CPI) {
            const int c0 = c_warp + it;
            if (c0 >= n_kv) {
                break; // the same for the whole warp
            }

            sfi_lane_kv<T, E> kh[CPI];
            sfi_lane_kv<T, E> vh[CPI];
            sfi_warp_load_rows<T, E, CPI>(kh, k_base, c0, n_kv, nbk1, lane);
            sfi_warp_load_rows<T, E, CPI>(vh, v_base, c0, n_kv, nbv1, lane);

            const float s = sfi_warp_cell_scores<half, T, E, NQ, CPI>(qr, qd, kh, c0, n_kv, n_q, softcap, m_base, sizeof(half), nbm1,
                    n_tokens, s_out, kn, b, h, n_head_kv, lane);

            // the iteration's max of each row, then every row's in every lane
            float m_it = s;
#pragma unroll
            for (int o = NQ; o < WARP_SIZE; o <<= 1) {
                m_it = fmaxf(m_it, __shfl_xor_sync(0xffffffff, m_it, o));
            }
            m_mine = fmaxf(m_mine, m_it);
            p_s[warp][lane] = s == -INFINITY ? 0.0f : expf(s - m_mine);

            float corr[NQ];
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                const float m_new = fmaxf(m_run[j], __shfl_sync(0xffffffff, m_it, j));
                corr[j]  = m_new == -INFINITY ? 1.0f : expf(m_run[j] - m_new);
                m_run[j] = m_new;
            }
            __syncwarp();

#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                s_run[j] *= corr[j];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    o_run[j][e] *= corr[j];
                }
            }
#pragma unroll
            for (int i = 0; i < CPI; ++i) {
                float vf[E];
                vh[i].values(vf);
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float w = p_s[warp][i*NQ + j];
                    s_run[j] += w;
                    float wv = w;
                    if constexpr (sfi_quantized(T)) {
                        wv *= vh[i].d;
                    }
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        o_run[j][e] += wv*vf[e];
                    }
                }
            }
            __syncwarp();
        }
    }

    // the block's part per row: the warps' merged
    __shared__ float m_w[N_WARPS][NQ];
    __shared__ float s_w[N_WARPS][NQ];
    __shared__ float o_w[N_WARPS][NQ][D];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        if (lane == 0) {
            m_w[warp][j] = m_run[j];
            s_w[warp][j] = s_run[j];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o_w[warp][j][lane*E + e] = o_run[j][e];
        }
    }
    __syncthreads();

    const size_t part0 = (pair*gridDim.y + part)*n_q;
    for (int i = threadIdx.x; i < n_q*D; i += blockDim.x) {
        const int j = i / D;
        const int d = i % D;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < N_WARPS; ++w) {
            m = fmaxf(m, m_w[w][j]);
        }
        float sum = 0.0f;
        float o   = 0.0f;
        if (m != -INFINITY) {
#pragma unroll
            for (int w = 0; w < N_WARPS; ++w) {
                const float f = m_w[w][j] == -INFINITY ? 0.0f : expf(m_w[w][j] - m);
                sum += s_w[w][j]*f;
                o   += o_w[w][j][d]*f;
            }
        }
        part_out[(part0 + j)*D + d] = o;
        if (d == 0) {
            parts[part0 + j] = make_float2(m, sum);
        }
    }
}

// per query row (j, h, bl): the n_parts blocks' parts merged, the output written in ggml_flash_attn_ext's layout, and
// the row's (max, sum^-alpha) for the evidence
template <int D>
static __global__ void __launch_bounds__(D) sfi_fae_combine(const float2 * __restrict__ parts, const float * __restrict__ part_out,
        float * __restrict__ out, float2 * __restrict__ stats,
        const int n_q, const int n_parts, const int n_tokens, const int n_gqa, const int n_head, const int b0, const float alpha) {
    const int    j    = blockIdx.x;
    const int    h    = blockIdx.y;
    const int    bl   = blockIdx.z;
    const size_t pair = (size_t) bl*gridDim.y + h;
    const int    d    = threadIdx.x;

    const float2 * p = parts    + pair*n_parts*n_q + j;
    const float  * o = part_out + (pair*n_parts*n_q + j)*D + d;

    float m = -INFINITY;
    for (int i = 0; i < n_parts; ++i) {
        m = fmaxf(m, p[(size_t) i*n_q].x);
    }
    float sum = 0.0f;
    float acc = 0.0f;
    if (m != -INFINITY) {
        for (int i = 0; i < n_parts; ++i) {
            const float2 pi = p[(size_t) i*n_q];
            const float  f  = pi.x == -INFINITY ? 0.0f : expf(pi.x - m);
            sum += pi.y*f;
            acc += o[(size_t) i*n_q*D]*f;
        }
    }

    const int b    = b0 + bl;
    const int head = h*n_gqa + j/n_tokens;
    const int t    = j % n_tokens;
    out[(((size_t) b*n_tokens + t)*n_head + head)*D + d] = sum > 0.0f ? acc/sum : 0.0f;
    if (d == 0) {
        stats[pair*n_q + j] = make_float2(m, m == -INFINITY || sum <= 0.0f ? 0.0f : powf(sum, -alpha));
    }
}

bool ggml_cuda_sfi_flash_attn_evidence_supported(const ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];

    const int64_t D   = q->ne[0];
    const int64_t n_q = q->ne[1]*(q->ne[2]/k->ne[2]);
    if (!sfi_kv_type_supported(k->type) || v->type != k->type || mask->type != GGML_TYPE_F16 || v->ne[0] != D) {
        return false;
    }
    if ((D != 64 && D != 128 && D != 256) || n_q > 8 || q->nb[0] != sizeof(float) || mask->nb[0] != sizeof(half)) {
        return false;
    }
    // a lane's load of a row: D/32 F16 values at once, or the values of a quantized block 2 bytes at a time
    const size_t align = k->type == GGML_TYPE_F16 ? D/WARP_SIZE*sizeof(half) : 2;
    for (const ggml_tensor * t : { k, v }) {
        if (t->nb[1] % align || t->nb[2] % align || t->nb[3] % align || t->view_offs % align) {
            return false;
        }
    }
    return (k->ne[1] + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK <= 65535 && q->ne[3] <= 65535;
}

// the blocks of sfi_fae_partial<D, NQ, T> an SM holds at once (its registers decide: 3 or 4 on sm_90 for F16)
template <int D, int NQ, ggml_type T>
static int sfi_fae_blocks_per_sm() {
    static const int n = [] {
        int blocks = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, sfi_fae_partial<D, NQ, T>, SFI_WARP_BLOCK_THREADS, 0));
        return std::max(1, blocks);
    }();
    return n;
}

template <int D, ggml_type T>
static void sfi_fae_launch(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const float scale   = ggml_get_op_params_f32(dst, 0);
    const float softcap = ggml_get_op_params_f32(dst, 1);
    const float alpha   = ggml_get_op_params_f32(dst, 2);
    const bool  norms   = ggml_get_op_params_i32(dst, 3) != 0;

    const int n_tokens  = (int) q->ne[1];
    const int n_head    = (int) q->ne[2];
    const int ns        = (int) q->ne[3];
    const int n_kv      = (int) k->ne[1];
    const int n_head_kv = (int) k->ne[2];
    const int n_gqa     = n_head/n_head_kv;
    const int n_q       = n_gqa*n_tokens;
    const int n_tiles   = (n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK;

    const float s_scale = softcap > 0.0f ? scale/softcap : scale;

    float * out  = (float *) dst->data;
    float * evid = out + (size_t) D*n_head*n_tokens*ns;
    float * kn   = norms ? evid + (size_t) n_kv*n_head_kv*ns : nullptr;

    cudaStream_t stream = ctx.stream();

    // (head, stream) pairs a chunk holds the scores of
    const size_t pair_bytes = (size_t) n_q*n_kv*sizeof(float);
    const int    nbl_max    = (int) std::max<size_t>(1, std::min<size_t>(ns, SFI_SCORES_MAX_BYTES/(pair_bytes*n_head_kv)));

    // parts per (head, stream) pair: as many blocks as the SMs hold at once, and no more (every block takes about
    // the same time, so a second wave of a few blocks would take nearly as long as the first)
    const int bps     = n_q <= 1 ? sfi_fae_blocks_per_sm<D, 1, T>() : n_q <= 2 ? sfi_fae_blocks_per_sm<D, 2, T>() :
                        n_q <= 4 ? sfi_fae_blocks_per_sm<D, 4, T>() : sfi_fae_blocks_per_sm<D, 8, T>();
    const int nsm     = ggml_cuda_info().devices[ctx.device].nsm;
    const int n_parts = std::max(1, std::min(n_tiles, bps*nsm/(n_head_kv*nbl_max)));

    ggml_cuda_pool_alloc<float>  scores  (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q*n_kv);
    ggml_cuda_pool_alloc<float2> parts   (ctx.pool(), (size_t) nbl_max*n_head_kv*n_parts*n_q);
    ggml_cuda_pool_alloc<float>  part_out(ctx.pool(), (size_t) nbl_max*n_head_kv*n_parts*n_q*D);
    ggml_cuda_pool_alloc<float2> stats   (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q);

    for (int b0 = 0; b0 < ns; b0 += nbl_max) {
        const int nbl = std::min(nbl_max, ns - b0);

        const dim3 grid(n_head_kv, n_parts, nbl);
        auto launch = [&](auto nq) {
            constexpr int NQ = decltype(nq)::value;
            sfi_fae_partial<D, NQ, T><<<grid, SFI_WARP_BLOCK_THREADS, 0, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) v->data, (const char *) mask->data,
                scores.get(), parts.get(), part_out.get(), kn,
                n_q, n_tokens, n_gqa, n_kv, n_head_kv, b0, (int) mask->ne[3], s_scale, softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], v->nb[1], v->nb[2], v->nb[3],
                mask->nb[1], mask->nb[3]);
        };
        if (n_q <= 1) {
            launch(std::integral_constant<int, 1>());
        } else if (n_q <= 2) {
            launch(std::integral_constant<int, 2>());
        } else if (n_q <= 4) {
            launch(std::integral_constant<int, 4>());
        } else {
            launch(std::integral_constant<int, 8>());
        }
        CUDA_CHECK(cudaGetLastError());

        sfi_fae_combine<D><<<dim3(n_q, n_head_kv, nbl), D, 0, stream>>>(
            parts.get(), part_out.get(), out, stats.get(), n_q, n_parts, n_tokens, n_gqa, n_head, b0, alpha);

        ggml_cuda_sfi_evidence_sum(scores.get(), stats.get(), evid, n_q, n_kv, n_head_kv, b0, nbl, alpha, stream);
        CUDA_CHECK(cudaGetLastError());
    }
}

template <ggml_type T>
static void sfi_fae_dispatch(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch (dst->src[0]->ne[0]) {
        case  64: sfi_fae_launch< 64, T>(ctx, dst); break;
        case 128: sfi_fae_launch<128, T>(ctx, dst); break;
        case 256: sfi_fae_launch<256, T>(ctx, dst); break;
        default: GGML_ABORT("unsupported head size");
    }
}

void ggml_cuda_op_sfi_flash_attn_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_sfi_flash_attn_evidence_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    switch (dst->src[1]->type) {
        case GGML_TYPE_F16:  sfi_fae_dispatch<GGML_TYPE_F16 >(ctx, dst); break;
        case GGML_TYPE_Q8_0: sfi_fae_dispatch<GGML_TYPE_Q8_0>(ctx, dst); break;
        case GGML_TYPE_Q4_0: sfi_fae_dispatch<GGML_TYPE_Q4_0>(ctx, dst); break;
        default: GGML_ABORT("unsupported key type");
    }
}
