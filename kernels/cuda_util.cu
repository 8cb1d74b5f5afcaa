/*
 * kernels/cuda_util.cu - the last CUDA error, kept as text for the binding
 * that turns ML_EDEVICE into a Lua error. One host thread drives the
 * device (STYLE.md: only the Lua thread calls kernels), so a plain buffer
 * is enough.
 */
#include <stdio.h>

#include "cuda_common.cuh"

static char last_error[256];

extern "C" void ml_cuda_note_error(const char *name, int code, const char *what)
{
    snprintf(last_error, sizeof last_error, "%s (%d): %s",
             name ? name : "cuda", code, what ? what : "");
}

extern "C" const char *ml_cuda_error_string(void)
{
    return last_error;
}
