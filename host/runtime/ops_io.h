/*
 * host/runtime/ops_io.h - tensors to and from safetensors files (DESIGN.md,
 * Files and formats: "a load goes straight into the unit, never through a
 * whole-model copy"): one entry, or one element range of an entry, of an
 * open file read into a tensor on any device; a tensor on any device
 * written to an element range of an entry (a rank's shard of a checkpoint
 * written by ranges, host/runtime/safetensors.h). Both go through bounded
 * host stages and convert between float dtypes.
 *
 * Inside a memory plan (h->planning) nothing is read or written, but every
 * argument is still checked: a plan dry-runs a checkpoint's save and load.
 *
 * Not here: the file format and its checks (safetensors.h), checkpoint
 * directories and which ranges a rank owns (lua/moelua/ckpt.lua), whole
 * files written at once (safetensors.h's ml_st_write_staged, driven by
 * host/bindings/l_io.c).
 */
#ifndef ML_OPS_IO_H
#define ML_OPS_IO_H

#include "op.h"
#include "safetensors.h"

/* Host bytes a read or write stages at a time (per stage; two when a
 * device tensor also needs a dtype conversion). */
#define ML_IO_STAGE_BYTES ((size_t)8 << 20)

/* Entry i of the open file f into dst (=): contiguous, as many elements as
 * the entry, on any device, of the entry's dtype or, between float dtypes
 * (f32, f64, bf16, f16), converted with the copy kernel's rounding. A CPU
 * destination of the entry's dtype is read in place; otherwise the bytes
 * go through host stages of at most ML_IO_STAGE_BYTES from the ledger (the
 * current category), released before returning. Inside a plan nothing is
 * read. ML_EIO: the file could not be read (e names it). */
ml_status ml_op_read_entry(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, ml_err *e);

/* Elements [off, off + numel(dst)) of entry i into dst (=), as
 * ml_op_read_entry reads a whole entry: only those bytes are read. */
ml_status ml_op_read_range(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, int64_t off,
                           ml_err *e);

/* src (contiguous, on any device, of the entry's dtype or, between float
 * dtypes, converted to it with the copy kernel's rounding) to elements
 * [off, off + numel(src)) of entry i of f, a file open for writing
 * (ml_st_create, ml_st_open_rw). A CPU source of the entry's dtype is
 * written in place; otherwise through host stages as reads. Inside a plan
 * f need only hold the entries (ml_st_layout's, fd -1): nothing is
 * written. ML_EIO: the file could not be written (e names it). */
ml_status ml_op_write_range(ml_host *h, const ml_st_file *f, size_t i, int64_t off,
                            const ml_tensor *src, ml_err *e);

#endif
