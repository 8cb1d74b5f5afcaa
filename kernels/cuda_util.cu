/*
 * kernels/cuda_util.cu - the last CUDA error, kept as text for the op that
 * turns ML_EDEVICE into a message, and two facts read once: the debug sync
 * switch and the SM count. One host thread drives the device (STYLE.md:
 * only the Lua thread calls kernels), so plain statics are enough.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"

static char last_error[256];

extern "C" void ml_cuda_note_error(const char *name, int code, const char *what)
{
    snprintf(last_error, sizeof last_error, "%s (%d): %s",
             name ? name : "cuda", code, what ? what : "");
}

extern "C" void ml_cuda_note_text(const char *what)
{
    snprintf(last_error, sizeof last_error, "%s", what ? what : "");
}

extern "C" const char *ml_cuda_error_string(void)
{
    return last_error;
}

extern "C" int ml_cuda_sync_debug(void)
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("MOELUA_CUDA_SYNC");
        on = v && strcmp(v, "1") == 0;
    }
    return on;
}

extern "C" int ml_cuda_sm_count(void)
{
    static int n = 0;
    if (n == 0) {
        int dev = 0, sms = 0;
        if (cudaGetDevice(&dev) != cudaSuccess
            || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess
            || sms < 1) {
            cudaGetLastError();   /* not an error of any kernel: clear it */
            sms = 1;
        }
        n = sms;
    }
    return n;
}
