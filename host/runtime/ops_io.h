/*
 * host/runtime/ops_io.h - tensors from safetensors files (DESIGN.md, Files
 * and formats: "a load goes straight into the unit, never through a
 * whole-model copy"): one entry of an open file read into a tensor on any
 * device, in bounded host stages.
 *
 * Not here: the file format and its checks (safetensors.h), checkpoint
 * directories (lua/moelua/ckpt.lua), writing (safetensors.h's
 * ml_st_write_staged, driven by host/bindings/l_io.c).
 */
#ifndef ML_OPS_IO_H
#define ML_OPS_IO_H

#include "op.h"
#include "safetensors.h"

/* Host bytes a read stages at a time (per stage; two when a device
 * destination also needs a dtype conversion). */
#define ML_IO_STAGE_BYTES ((size_t)8 << 20)

/* Entry i of the open file f into dst (=): contiguous, as many elements as
 * the entry, on any device, of the entry's dtype or, between float dtypes
 * (f32, f64, bf16, f16), converted with the copy kernel's rounding. A CPU
 * destination of the entry's dtype is read in place; otherwise the bytes
 * go through host stages of at most ML_IO_STAGE_BYTES from the ledger (the
 * current category), released before returning. Inside a plan nothing is
 * read. ML_EIO: the file could not be read (e names it). */
ml_status ml_op_read_entry(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, ml_err *e);

#endif
