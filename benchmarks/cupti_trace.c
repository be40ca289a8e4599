// A kernel trace without a profiler: loaded by the CUDA driver through CUDA_INJECTION64_PATH, it records every kernel
// (inside CUDA graphs too) and every device-to-host copy with their GPU start and end times, and writes them as CSV
// to $SFI_CUPTI_TRACE at exit. benchmarks/cupti_steps.py cuts the trace into decode steps (a step ends with the copy
// of its logits) and sums each step's kernels by name.
//
//   gcc -shared -fPIC -O2 -I<cupti include> -I<cuda include> benchmarks/cupti_trace.c -o libsfi_cupti_trace.so \
//       -L<dir of libcupti.so.13> -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
//   CUDA_INJECTION64_PATH=$PWD/libsfi_cupti_trace.so SFI_CUPTI_TRACE=trace.csv python3 benchmarks/native_step_bench.py ...
#include <cupti.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_SIZE (8u << 20)

static FILE * trace_out;

static void CUPTIAPI buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_records) {
    *buffer      = (uint8_t *) aligned_alloc(8, BUF_SIZE);
    *size        = BUF_SIZE;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t * buffer, size_t size, size_t valid) {
    (void) ctx; (void) stream; (void) size;
    CUpti_Activity * rec = NULL;
    while (trace_out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel9 * k = (const CUpti_ActivityKernel9 *) rec;
            fprintf(trace_out, "K,%llu,%llu,%u,%u,%s\n", (unsigned long long) k->start, (unsigned long long) k->end,
                    k->streamId, k->graphId, k->name ? k->name : "?");
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy5 * m = (const CUpti_ActivityMemcpy5 *) rec;
            fprintf(trace_out, "M,%llu,%llu,%u,%u,kind%u_%llu\n", (unsigned long long) m->start, (unsigned long long) m->end,
                    m->streamId, m->graphId, (unsigned) m->copyKind, (unsigned long long) m->bytes);
        }
    }
    free(buffer);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(1);
    if (trace_out) {
        fclose(trace_out);
        trace_out = NULL;
    }
}

int InitializeInjection(void) {
    const char * path = getenv("SFI_CUPTI_TRACE");
    trace_out = fopen(path ? path : "cupti_trace.csv", "w");
    if (!trace_out) {
        return 0;
    }
    fprintf(trace_out, "kind,start_ns,end_ns,stream,graph,name\n");
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    atexit(flush_at_exit);
    return 1;
}
