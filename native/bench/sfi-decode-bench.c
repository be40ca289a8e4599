// Pure C dense decode benchmark in the style of llama-bench (tg after a prefill of a given depth).
// It is the yardstick for the Python decoding loop: same library, same context settings, no Python.
// Prints one JSON object on stdout.
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static void quiet_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static void usage(const char * argv0) {
    fprintf(stderr,
        "usage: %s -m MODEL [-d DEPTH] [-n N_DECODE] [-c N_CTX] [-ngl N_GPU_LAYERS] [-t THREADS] [-fa 0|1] [-b N_BATCH]\n",
        argv0);
}

int main(int argc, char ** argv) {
    const char * model_path = NULL;
    int depth = 512, n_decode = 64, n_ctx = 0, n_gpu_layers = 0, n_threads = 0, flash_attn = 1, n_batch = 2048;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) { usage(argv[0]); return 2; }
        if      (!strcmp(a, "-m"))   { model_path   = v; }
        else if (!strcmp(a, "-d"))   { depth        = atoi(v); }
        else if (!strcmp(a, "-n"))   { n_decode     = atoi(v); }
        else if (!strcmp(a, "-c"))   { n_ctx        = atoi(v); }
        else if (!strcmp(a, "-ngl")) { n_gpu_layers = atoi(v); }
        else if (!strcmp(a, "-t"))   { n_threads    = atoi(v); }
        else if (!strcmp(a, "-fa"))  { flash_attn   = atoi(v); }
        else if (!strcmp(a, "-b"))   { n_batch      = atoi(v); }
        else { usage(argv[0]); return 2; }
        i++;
    }
    if (model_path == NULL || depth < 1 || n_decode < 1) { usage(argv[0]); return 2; }
    if (n_ctx <= 0) { n_ctx = depth + n_decode + 16; }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();

    struct llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = n_gpu_layers;
    struct llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (model == NULL) { fprintf(stderr, "cannot load %s\n", model_path); return 1; }

    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) n_ctx;
    cparams.n_batch = (uint32_t) n_batch;
    cparams.n_ubatch = (uint32_t) (n_batch < 512 ? n_batch : 512);
    cparams.n_seq_max = 1;
    cparams.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (n_threads > 0) { cparams.n_threads = n_threads; cparams.n_threads_batch = n_threads; }
    struct llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == NULL) { fprintf(stderr, "cannot create context\n"); return 1; }

    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token * tokens = malloc(sizeof(llama_token) * (size_t) n_batch);

    // prefill: pseudo-random tokens, as llama-bench does
    unsigned int seed = 1234;
    const double t_prefill0 = now_s();
    for (int p = 0; p < depth; p += n_batch) {
        const int n = depth - p < n_batch ? depth - p : n_batch;
        for (int i = 0; i < n; i++) { seed = seed * 1103515245u + 12345u; tokens[i] = (llama_token) (seed % (unsigned) n_vocab); }
        if (llama_decode(ctx, llama_batch_get_one(tokens, n)) != 0) { fprintf(stderr, "prefill failed\n"); return 1; }
    }
    llama_synchronize(ctx);
    const double t_prefill = now_s() - t_prefill0;

    // decode: one token per step; one warm-up step not timed
    llama_token tok = 0;
    if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    llama_synchronize(ctx);
    const double t0 = now_s();
    for (int i = 0; i < n_decode; i++) {
        tok = (llama_token) ((i * 7919) % n_vocab);
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        llama_synchronize(ctx);
    }
    const double t_decode = now_s() - t0;

    printf("{\"depth\": %d, \"n_decode\": %d, \"prefill_s\": %.4f, \"decode_s\": %.4f, \"decode_tok_s\": %.3f}\n",
           depth, n_decode, t_prefill, t_decode, n_decode / t_decode);

    free(tokens);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
