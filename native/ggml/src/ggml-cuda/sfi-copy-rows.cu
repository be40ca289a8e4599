// ggml_sfi_copy_rows: the threads of a block copy SFI_COPY_UNITS units of T (16 bytes where the rows and their
// addresses allow it) of consecutive rows i of one (j, l)

#include "sfi-copy-rows.cuh"

#include <climits>

static constexpr int SFI_COPY_THREADS = 256;
static constexpr int SFI_COPY_UNITS   = 1024; // per block

template <typename T>
static __global__ void sfi_copy_rows(const char * __restrict__ src, char * __restrict__ dst,
        const char * __restrict__ idx, const int64_t * __restrict__ slots,
        const int n, const int units_per_row,
        const size_t nbs1, const size_t nbs2, const size_t nbs3,
        const size_t nbd1, const size_t nbd2, const size_t nbd3,
        const size_t nbi0, const size_t nbi1, const size_t nbi2) {
    const int j = blockIdx.y;
    const int l = blockIdx.z;

    const int rows_per_block = max(1, SFI_COPY_UNITS/units_per_row);
    const int i0 = blockIdx.x*rows_per_block;

    for (int u = threadIdx.x; u < rows_per_block*units_per_row; u += blockDim.x) {
        const int i = i0 + u/units_per_row;
        const int e = u % units_per_row;
        if (i >= n) {
            break;
        }
        const int32_t c = *(const int32_t *) (idx + i*nbi0 + j*nbi1 + l*nbi2);
        const T * s = (const T *) (src + c*nbs1 + j*nbs2 + l*nbs3);
        T       * d = (T       *) (dst + slots[i]*nbd1 + j*nbd2 + l*nbd3);
        d[e] = s[e];
    }
}

bool ggml_cuda_sfi_copy_rows_supported(const ggml_tensor * op) {
    const ggml_tensor * idx = op->src[2];
    return idx->ne[1] <= 65535 && idx->ne[2] <= 65535 && idx->ne[0] <= INT_MAX;
}

void ggml_cuda_op_sfi_copy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * d     = dst->src[0];
    const ggml_tensor * src   = dst->src[1];
    const ggml_tensor * idx   = dst->src[2];
    const ggml_tensor * slots = dst->src[3];

    GGML_ASSERT(ggml_cuda_sfi_copy_rows_supported(dst));

    const int    n   = (int) idx->ne[0];
    const size_t row = ggml_row_size(src->type, src->ne[0]);

    // the widest unit every row start and length is a multiple of
    uintptr_t a = row | (uintptr_t) src->data | (uintptr_t) d->data;
    for (int i = 1; i < 4; ++i) {
        a |= src->nb[i] | d->nb[i];
    }
    const size_t unit = a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : 1;

    const int units_per_row  = (int) (row/unit);
    const int rows_per_block = std::max(1, SFI_COPY_UNITS/units_per_row);

    const dim3 grid((n + rows_per_block - 1)/rows_per_block, idx->ne[1], idx->ne[2]);

    auto launch = [&](auto t) {
        using T = decltype(t);
        sfi_copy_rows<T><<<grid, SFI_COPY_THREADS, 0, ctx.stream()>>>(
            (const char *) src->data, (char *) d->data, (const char *) idx->data, (const int64_t *) slots->data,
            n, units_per_row, src->nb[1], src->nb[2], src->nb[3], d->nb[1], d->nb[2], d->nb[3], idx->nb[0], idx->nb[1], idx->nb[2]);
    };
    switch (unit) {
        case 16: launch(uint4());    break;
        case  8: launch(uint2());    break;
        case  4: launch(uint32_t()); break;
        default: launch(uint8_t());  break;
    }
    CUDA_CHECK(cudaGetLastError());
}
