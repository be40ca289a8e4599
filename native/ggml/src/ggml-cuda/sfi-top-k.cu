// ggml_sfi_top_k: one block per row, a radix select over the values as ordered 32-bit keys, 8 bits at a time from
// the top (four histogram passes find the k-th largest key exactly), then one pass in index order that writes the
// keys above it and the first of those equal to it. Each thread takes SFI_TOP_K_PER_THREAD consecutive values of a
// chunk, so that a block keeps enough loads in flight on a row of 128K cells.
//
// A few long rows (a sampler's logits: one row of a vocabulary per sequence) would keep a few SMs busy for five
// passes over the row; they take two launches instead: the row's segments' k largest on many blocks, then the k
// largest of those candidates. Segments and their candidates are in index order, so the ties at the k-th value
// resolve to the first indices and the result equals the one-launch result.

#include "sfi-top-k.cuh"

#include <climits>

static constexpr int SFI_TOP_K_THREADS    = 1024;
static constexpr int SFI_TOP_K_PER_THREAD = 8;

// larger floats to larger keys; -0 to the key of +0
static __device__ __forceinline__ uint32_t sfi_ordered_key(float v) {
    uint32_t b = __float_as_uint(v);
    b = b == 0x80000000u ? 0u : b;
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// exclusive scan over the block of one value per thread (buf: a value per warp); *total gets the sum
static __device__ __forceinline__ int sfi_block_exclusive_scan(int v, int * buf, int * total) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    const int incl = warp_prefix_inclusive_sum<int>(v);
    __syncthreads();
    if (lane == WARP_SIZE - 1) {
        buf[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x/WARP_SIZE;
        const int w = warp_prefix_inclusive_sum<int>(lane < n_warps ? buf[lane] : 0);
        if (lane < n_warps) {
            buf[lane] = w; // inclusive over the warps
        }
    }
    __syncthreads();
    *total = buf[blockDim.x/WARP_SIZE - 1];
    return (warp > 0 ? buf[warp - 1] : 0) + incl - v;
}

// block b: segment b % n_seg of row b / n_seg (the rows n values apart), its k largest to dst (and their values to
// dst_val where given) at b*k
static __global__ void __launch_bounds__(SFI_TOP_K_THREADS) sfi_top_k_kernel(
        const float * __restrict__ x, const int32_t * __restrict__ ids, int32_t * __restrict__ dst,
        float * __restrict__ dst_val, const int n_row, const int k, const int ne1, const int n_seg) {
    const int row = blockIdx.x / n_seg;
    const int seg = blockIdx.x % n_seg;
    const int s0  = (int) ((int64_t) seg*n_row/n_seg);
    const int n   = (int) ((int64_t) (seg + 1)*n_row/n_seg) - s0;

    const float   * xr    = x + (size_t) row*n_row + s0;
    int32_t       * out   = dst + (size_t) blockIdx.x*k;
    float         * out_v = dst_val ? dst_val + (size_t) blockIdx.x*k : nullptr;
    const int32_t * ids_r = ids ? ids + (size_t) (row/ne1)*n_row + s0 : nullptr; // the row's ids: those of its (i2, i3)

    __shared__ int hist[256];
    __shared__ int buf[WARP_SIZE];
    __shared__ int s_bin, s_above;

    constexpr int CHUNK = SFI_TOP_K_THREADS*SFI_TOP_K_PER_THREAD;

    const int lane = threadIdx.x % WARP_SIZE;

    uint32_t prefix = 0;
    uint32_t mask   = 0;
    int      rem    = k; // how many of the keys under the prefix are still to take

    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();

        for (int c0 = 0; c0 < n; c0 += CHUNK) {
            const int i0 = c0 + threadIdx.x*SFI_TOP_K_PER_THREAD;
            float v[SFI_TOP_K_PER_THREAD];
#pragma unroll
            for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
                v[e] = i0 + e < n ? xr[i0 + e] : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
                const uint32_t key = sfi_ordered_key(v[e]);
                const int bin = i0 + e < n && (key & mask) == prefix ? (int) ((key >> shift) & 255) : -1;
                // one atomic per distinct bin of the warp (many equal values, e.g. excluded cells, share a bin)
                const unsigned peers = __match_any_sync(0xffffffff, bin);
                if (bin >= 0 && lane == __ffs(peers) - 1) {
                    atomicAdd(&hist[bin], __popc(peers));
                }
            }
        }
        __syncthreads();

        // the bin of the rem-th largest key under the prefix: warp 0, 8 bins per lane from the top
        if (threadIdx.x < WARP_SIZE) {
            int cnt[8];
            int sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                cnt[j] = hist[255 - (lane*8 + j)];
                sum += cnt[j];
            }
            const int incl = warp_prefix_inclusive_sum<int>(sum);
            const int excl = incl - sum;
            if (excl < rem && rem <= incl) {
                int acc = excl;
                for (int j = 0; j < 8; ++j) {
                    if (acc + cnt[j] >= rem) {
                        s_bin   = 255 - (lane*8 + j);
                        s_above = acc;
                        break;
                    }
                    acc += cnt[j];
                }
            }
        }
        __syncthreads();

        prefix |= (uint32_t) s_bin << shift;
        mask   |= 255u << shift;
        rem    -= s_above;
        __syncthreads();
    }

    // prefix is the k-th largest key: every key above it, and the first rem keys equal to it, in index order
    int written  = 0;
    int eq_taken = 0;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int i0 = c0 + threadIdx.x*SFI_TOP_K_PER_THREAD;

        uint32_t key[SFI_TOP_K_PER_THREAD];
        int n_gt = 0;
        int n_eq = 0;
#pragma unroll
        for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
            key[e] = i0 + e < n ? sfi_ordered_key(xr[i0 + e]) : 0u;
            n_gt += i0 + e < n && key[e] >  prefix;
            n_eq += i0 + e < n && key[e] == prefix;
        }

        int total_gt, total_eq;
        int gt_before = sfi_block_exclusive_scan(n_gt, buf, &total_gt);
        int eq_before = sfi_block_exclusive_scan(n_eq, buf, &total_eq);

        const int eq_left = rem - eq_taken; // equal keys still to take, in index order
        int pos = written + gt_before + min(eq_before, max(eq_left, 0));
        int eq  = eq_before;
#pragma unroll
        for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
            if (i0 + e >= n) {
                break;
            }
            if (key[e] > prefix || (key[e] == prefix && eq++ < eq_left)) {
                if (out_v) {
                    out_v[pos] = xr[i0 + e];
                }
                out[pos++] = ids_r ? ids_r[i0 + e] : s0 + i0 + e;
            }
        }

        written  += total_gt + min(total_eq, max(eq_left, 0));
        eq_taken += total_eq;
    }
}

bool ggml_cuda_sfi_top_k_supported(const ggml_tensor * op) {
    const ggml_tensor * a = op->src[0];
    return a->type == GGML_TYPE_F32 && ggml_is_contiguous(a) && a->ne[0] <= INT32_MAX/2 && ggml_nrows(a) <= INT32_MAX;
}

// long rows split into segments of about this many values ...
static constexpr int SFI_TOP_K_SEGMENT = 4096;

// ... when they are fewer than a quarter of the SMs and a segment is much longer than k: the segments per row (1: one
// launch)
static int sfi_top_k_n_seg(const int n, const int k, const int n_rows, const int nsm) {
    if (4*n_rows > nsm || n < 2*SFI_TOP_K_SEGMENT || 4*k > SFI_TOP_K_SEGMENT) {
        return 1;
    }
    return std::min(n/SFI_TOP_K_SEGMENT, std::max(nsm/n_rows, 1));
}

void ggml_cuda_op_sfi_top_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * a = dst->src[0];

    GGML_ASSERT(ggml_cuda_sfi_top_k_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));

    const int n      = (int) a->ne[0];
    const int k      = (int) dst->ne[0];
    const int n_rows = (int) ggml_nrows(a);
    const int n_seg  = sfi_top_k_n_seg(n, k, n_rows, ggml_cuda_info().devices[ctx.device].nsm);

    const ggml_tensor * ids = dst->src[1];
    cudaStream_t stream = ctx.stream();

    if (n_seg == 1) {
        sfi_top_k_kernel<<<n_rows, SFI_TOP_K_THREADS, 0, stream>>>((const float *) a->data,
            ids ? (const int32_t *) ids->data : nullptr, (int32_t *) dst->data, nullptr, n, k, (int) a->ne[1], 1);
        CUDA_CHECK(cudaGetLastError());
        return;
    }

    // each segment's k largest (ids in the row, or through ids), with their values; then the k largest of those
    const int n_cand = n_seg*k;
    ggml_cuda_pool_alloc<int32_t> cand_ids(ctx.pool(), (size_t) n_rows*n_cand);
    ggml_cuda_pool_alloc<float>   cand_val(ctx.pool(), (size_t) n_rows*n_cand);

    sfi_top_k_kernel<<<n_rows*n_seg, SFI_TOP_K_THREADS, 0, stream>>>((const float *) a->data,
        ids ? (const int32_t *) ids->data : nullptr, cand_ids.get(), cand_val.get(), n, k, (int) a->ne[1], n_seg);
    CUDA_CHECK(cudaGetLastError());
    sfi_top_k_kernel<<<n_rows, SFI_TOP_K_THREADS, 0, stream>>>(cand_val.get(), cand_ids.get(), (int32_t *) dst->data,
        nullptr, n_cand, k, 1, 1);
    CUDA_CHECK(cudaGetLastError());
}
