#pragma once

// ggml_sfi_sample's pick among a row's candidates (see ggml-sfi.h), one definition for the CPU and CUDA: the same
// arithmetic as llama.cpp's host samplers top-p, min-p, temperature and dist, in their order and precision (float
// probabilities; dist's sums in double), so that the picks differ from theirs only where expf rounds otherwise.

#include <math.h>

#ifdef __CUDACC__
#define GGML_SFI_HOST_DEVICE __host__ __device__
#else
#define GGML_SFI_HOST_DEVICE
#endif

// c: the k candidates' logits, largest first; u in [0, 1); the position in c of the pick
static GGML_SFI_HOST_DEVICE inline int ggml_sfi_sample_pick(const float * c, int k, float top_p, float min_p, float temp, float u) {
    int n = k;

    // top-p: softmax over the k candidates, kept up to the first whose running sum reaches top_p
    if (top_p < 1.0f) {
        float sum = 0.0f;
        for (int i = 0; i < k; ++i) {
            sum += expf(c[i] - c[0]);
        }
        float cum = 0.0f;
        for (int i = 0; i < k; ++i) {
            cum += expf(c[i] - c[0])/sum;
            if (cum >= top_p) {
                n = i + 1;
                break;
            }
        }
    }

    // min-p: p_i >= min_p*p_0, the first always kept
    if (min_p > 0.0f) {
        const float min_logit = c[0] + logf(min_p);
        int i = 1;
        while (i < n && c[i] >= min_logit) {
            ++i;
        }
        n = i;
    }

    if (n == 1) {
        return 0;
    }

    // temperature, then dist: the first whose running sum reaches u times the sum
    const float max_l = c[0]/temp;
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
        sum += expf(c[i]/temp - max_l);
    }
    const double target = sum*u;
    double run = 0.0;
    for (int i = 0; i < n; ++i) {
        run += expf(c[i]/temp - max_l);
        if (run >= target) {
            return i;
        }
    }
    return n - 1;
}
