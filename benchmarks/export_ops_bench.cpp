// Times the ggml ops of an SFI slow step's export (llama_sfi_build_export, native/src/llama-sfi-export.cpp) on the
// best backend (CUDA when built with it), one graph per stage with the op repeated for every layer,
// so that a slow step's cost can be split into stages without a profiler.
//
//   g++ -O2 -std=c++17 benchmarks/export_ops_bench.cpp -I<llama.cpp>/ggml/include -L<lib> -lggml -lggml-base \
//       -Wl,-rpath,<lib> -o export_ops_bench && ./export_ops_bench 131072 8192
//
// Shapes: Qwen3-4B (36 layers, 32 query / 8 KV heads, head_dim 128), F16 K cache, one query row.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

static const int N_LAYERS = 36, N_HEAD = 32, N_HEAD_KV = 8, HEAD_DIM = 128;

struct inputs {
    ggml_tensor * k;     // F16 [HEAD_DIM, N_HEAD_KV, n_kv] (the cache layout)
    ggml_tensor * q;     // F32 [HEAD_DIM, N_HEAD, 1]
    ggml_tensor * mask;  // F16 [n_kv, 1]
    ggml_tensor * p;     // F32 [n_kv, 1, N_HEAD] (probabilities)
    ggml_tensor * score; // F32 [n_kv]
};

static ggml_tensor * group_sum(ggml_context * ctx, ggml_tensor * p, int64_t n_kv) {
    p = ggml_reshape_3d(ctx, p, n_kv, N_HEAD / N_HEAD_KV, N_HEAD_KV);
    return ggml_sum_rows(ctx, ggml_cont(ctx, ggml_permute(ctx, p, 1, 0, 2, 3)));
}

// the same sum by halving with adds of strided views (what the export does)
static ggml_tensor * group_sum_halving(ggml_context * ctx, ggml_tensor * p, int64_t n_kv) {
    int64_t n = N_HEAD / N_HEAD_KV;
    p = ggml_reshape_3d(ctx, p, n_kv, n, N_HEAD_KV);
    while (n > 1) {
        p = ggml_add(ctx, ggml_view_3d(ctx, p, n_kv, n/2, N_HEAD_KV, p->nb[1], p->nb[2], 0),
                          ggml_view_3d(ctx, p, n_kv, n/2, N_HEAD_KV, p->nb[1], p->nb[2], (n/2)*p->nb[1]));
        n /= 2;
    }
    return p;
}

static void fill(ggml_tensor * t, std::mt19937 & rng) {
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F16) {
        std::vector<ggml_fp16_t> v(n);
        for (auto & x : v) x = ggml_fp32_to_fp16(u(rng) - 0.5f);
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    } else {
        std::vector<float> v(n);
        for (auto & x : v) x = u(rng) / 1000.0f;
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    }
}

int main(int argc, char ** argv) {
    const int64_t n_kv   = argc > 1 ? atoll(argv[1]) : 131072;
    const int64_t n_cand = argc > 2 ? atoll(argv[2]) : 8192;
    const int     reps   = argc > 3 ? atoi(argv[3]) : 20;

    ggml_backend_load_all();
    ggml_backend_t backend = ggml_backend_init_best();
    printf("backend %s, n_kv %lld, n_cand %lld, %d layers\n", ggml_backend_name(backend), (long long) n_kv,
           (long long) n_cand, N_LAYERS);

    ggml_init_params ip = { 16 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx_in = ggml_init(ip);
    inputs in;
    in.k     = ggml_new_tensor_3d(ctx_in, GGML_TYPE_F16, HEAD_DIM, N_HEAD_KV, n_kv);
    in.q     = ggml_new_tensor_3d(ctx_in, GGML_TYPE_F32, HEAD_DIM, N_HEAD, 1);
    in.mask  = ggml_new_tensor_2d(ctx_in, GGML_TYPE_F16, n_kv, 1);
    in.p     = ggml_new_tensor_3d(ctx_in, GGML_TYPE_F32, n_kv, 1, N_HEAD);
    in.score = ggml_new_tensor_1d(ctx_in, GGML_TYPE_F32, n_kv);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx_in, backend);
    std::mt19937 rng(0);
    fill(in.k, rng); fill(in.q, rng); fill(in.p, rng); fill(in.score, rng);
    {
        std::vector<ggml_fp16_t> m(n_kv, ggml_fp32_to_fp16(0.0f));
        ggml_backend_tensor_set(in.mask, m.data(), 0, ggml_nbytes(in.mask));
    }

    // one stage: f builds the op of one layer; the graph holds N_LAYERS of them
    auto bench = [&](const char * name, const std::function<ggml_tensor *(ggml_context *)> & f) {
        ggml_init_params gp = { 4096 * ggml_tensor_overhead() + ggml_graph_overhead_custom(8192, false), nullptr, true };
        ggml_context * ctx = ggml_init(gp);
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, 8192, false);
        for (int il = 0; il < N_LAYERS; ++il) {
            ggml_tensor * out = f(ctx);
            ggml_set_output(out);
            ggml_build_forward_expand(gf, out);
        }
        ggml_gallocr_t alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
        if (!ggml_gallocr_alloc_graph(alloc, gf)) {
            printf("%-28s alloc failed\n", name);
            return;
        }
        for (int i = 0; i < 3; ++i) ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
        printf("%-28s %8.3f ms for %d layers (%.3f ms per layer, %d nodes)\n", name, ms, N_LAYERS, ms / N_LAYERS,
               ggml_graph_n_nodes(gf));
        ggml_gallocr_free(alloc);
        ggml_free(ctx);
    };

    const float scale = 1.0f / sqrtf((float) HEAD_DIM);
    auto kq = [&](ggml_context * ctx) {
        ggml_tensor * q = ggml_permute(ctx, in.q, 0, 2, 1, 3);
        ggml_tensor * r = ggml_mul_mat(ctx, ggml_permute(ctx, in.k, 0, 2, 1, 3), q);
        ggml_prec_set_acc(r, GGML_PREC_F32);
        return r;
    };
    const int64_t n_chunks256 = n_kv / 256, n_chunks1024 = n_kv / 1024;
    const int r256  = std::min<int64_t>(256, std::max<int64_t>(1, 2 * n_cand / std::max<int64_t>(1, n_chunks256)));
    const int r1024 = std::min<int64_t>(1024, std::max<int64_t>(1, 2 * n_cand / std::max<int64_t>(1, n_chunks1024)));

    bench("kq (permuted K, 1 row)", kq);
    bench("kq + soft_max", [&](ggml_context * ctx) { return ggml_soft_max_ext(ctx, kq(ctx), in.mask, scale, 0.0f); });
    // one op per layer on few long rows (one CUDA block per row) against one op on every layer's rows
    bench("soft_max, 32 rows per layer", [&](ggml_context * ctx) { return ggml_soft_max_ext(ctx, in.p, in.mask, scale, 0.0f); });
    bench("soft_max, 8 rows per layer", [&](ggml_context * ctx) {
        return ggml_soft_max_ext(ctx, ggml_view_3d(ctx, in.p, n_kv, 1, N_HEAD_KV, in.p->nb[1], in.p->nb[2], 0), in.mask, scale, 0.0f); });
    {
        int first = 1;
        bench("soft_max of all layers' 32 rows (1 op)", [&](ggml_context * ctx) {
            ggml_tensor * all = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_kv, 1, N_HEAD * N_LAYERS);
            ggml_tensor * r = first ? ggml_soft_max_ext(ctx, all, in.mask, scale, 0.0f) : ggml_scale(ctx, in.score, 1.0f);
            first = 0;
            return r;
        });
    }
    bench("group_sum (mass)", [&](ggml_context * ctx) { return group_sum(ctx, in.p, n_kv); });
    bench("group_sum by halving (0006)", [&](ggml_context * ctx) { return group_sum_halving(ctx, in.p, n_kv); });
    bench("sqrt + group_sum (evidence)", [&](ggml_context * ctx) { return group_sum(ctx, ggml_sqrt(ctx, in.p), n_kv); });
    bench("rows_per_cell + sum_rows", [&](ggml_context * ctx) {
        ggml_tensor * m = group_sum(ctx, in.p, n_kv);
        m = ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, m, n_kv, N_HEAD_KV)));
        return ggml_sum_rows(ctx, m);
    });
    bench("top_k (whole row)", [&](ggml_context * ctx) { return ggml_top_k(ctx, in.score, n_cand); });
    if (n_kv % 256 == 0) {
        char name[64];
        snprintf(name, sizeof(name), "top_k chunks of 256 (r %d)", r256);
        bench(name, [&](ggml_context * ctx) { return ggml_top_k(ctx, ggml_reshape_2d(ctx, in.score, 256, n_chunks256), r256); });
    }
    if (n_kv % 1024 == 0) {
        char name[64];
        snprintf(name, sizeof(name), "top_k chunks of 1024 (r %d)", r1024);
        bench(name, [&](ggml_context * ctx) { return ggml_top_k(ctx, ggml_reshape_2d(ctx, in.score, 1024, n_chunks1024), r1024); });
    }
    bench("argsort (whole row)", [&](ggml_context * ctx) { return ggml_argsort(ctx, in.score, GGML_SORT_ORDER_DESC); });
    bench("key norms of candidates", [&](ggml_context * ctx) {
        ggml_tensor * cells = ggml_top_k(ctx, in.score, n_cand);
        ggml_tensor * k_rows = ggml_view_2d(ctx, in.k, HEAD_DIM * N_HEAD_KV, n_kv, in.k->nb[2], 0);
        ggml_tensor * kn = ggml_reshape_3d(ctx, ggml_get_rows(ctx, k_rows, cells), HEAD_DIM, N_HEAD_KV, n_cand);
        return ggml_sqrt(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, kn)));
    });
    // the export of the candidates' mass and evidence, with either group sum
    using group_sum_fn = ggml_tensor * (*)(ggml_context *, ggml_tensor *, int64_t);
    auto whole_export = [&](group_sum_fn sum) {
        return [&, sum](ggml_context * ctx) {
            ggml_tensor * p = ggml_soft_max_ext(ctx, kq(ctx), in.mask, scale, 0.0f);
            auto rows = [&](ggml_tensor * t) { return ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, t, n_kv, N_HEAD_KV))); };
            ggml_tensor * mass = rows(sum(ctx, p, n_kv));
            ggml_tensor * evid = rows(sum(ctx, ggml_sqrt(ctx, p), n_kv));
            ggml_tensor * cells = ggml_top_k(ctx, ggml_reshape_1d(ctx, ggml_sum_rows(ctx, evid), n_kv), n_cand);
            ggml_tensor * a = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, mass, cells)));
            ggml_tensor * b = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, evid, cells)));
            return ggml_add(ctx, a, b);
        };
    };
    bench("whole export (permuted group sum)", whole_export(group_sum));
    bench("whole export (group sum by halving)", whole_export(group_sum_halving));

    ggml_backend_buffer_free(buf);
    ggml_free(ctx_in);
    ggml_backend_free(backend);
    return 0;
}
