/*
 * host/runtime/safetensors.h - reading and writing safetensors files
 * (https://github.com/huggingface/safetensors): an 8-byte little-endian
 * header length, a JSON header naming each tensor's dtype, shape and
 * data_offsets, then the data section.
 *
 * The reader treats the file as untrusted input (DESIGN.md, Files and
 * formats): every length, offset, shape and dtype is checked, the JSON header
 * goes through a small strict parser of our own, and every violation comes
 * back as an error string naming the file and the tensor, never as a crash
 * or a read outside the file. Tensors must tile the data section exactly.
 * The writer orders tensors by element size (descending, then by name) so
 * each is aligned to its element size, and replaces the file atomically
 * (<path>.tmp, fsync, rename, fsync of the directory).
 *
 * A file can also be written by element ranges, by several processes at
 * once (a sharded checkpoint: each rank writes the ranges it owns):
 * ml_st_layout computes the header up front from names, dtypes and shapes,
 * one process creates the file at its final length (ml_st_create), and
 * every writer, with its own open file (ml_st_create's or ml_st_open_rw's),
 * pwrites ranges of entries at their final offsets, in any order
 * (ml_st_write_range). Once every range is written the file is, byte for
 * byte, the one ml_st_write writes for the same tensors and metadata: an
 * ordinary safetensors file. Such a file is not replaced atomically: the
 * caller makes the directory that holds it atomic.
 *
 * Not here: Lua (host/bindings/l_io.c binds this), tensors and allocation of tensor
 * data (the caller reads into memory it owns), which ranges a rank owns. Device
 * data is written through a host stage the caller owns (ml_st_write_staged),
 * never through a host copy of the whole tensor. The data bytes are the
 * host's, which must be little-endian, as the format is.
 */
#ifndef ML_SAFETENSORS_H
#define ML_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

#define ML_ST_MAX_HEADER 100000000u   /* bytes; the limit the reference implementation uses */

/* One tensor of a parsed file. */
typedef struct {
    const char *name;           /* NUL-terminated UTF-8, points into the file's string arena */
    ml_dtype dtype;
    int ndim;                   /* 0: a scalar */
    int64_t shape[ML_MAXDIM];
    uint64_t begin, end;        /* byte range in the data section; end - begin = numel * size */
} ml_st_entry;

typedef struct {
    const char *key, *value;    /* one __metadata__ pair, NUL-terminated UTF-8 */
} ml_st_pair;

/* A parsed file. Entries are sorted by data offset (the order to read them
 * in); metadata pairs are in header order. */
typedef struct {
    ml_st_entry *entries;
    size_t nentries;
    ml_st_pair *meta;
    size_t nmeta;
    uint64_t data_start;        /* file offset of the data section: 8 + header length */
    uint64_t data_size;         /* bytes in the data section */
    char *arena;                /* decoded strings */
    char *label;                /* the path, for messages */
    int fd;                     /* open file (ml_st_open), -1 otherwise */
    int writable;               /* fd open for ml_st_write_range (ml_st_create, ml_st_open_rw) */
} ml_st_file;

struct ml_memory;

/* A tensor to write: `data` holds numel * size bytes, contiguous, row-major
 * (NULL allowed when that is 0), in host memory, or in a device's memory
 * when `mem` (that device's memory table, host/runtime/backend.h) is set. */
typedef struct {
    const char *name;
    ml_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;
    const struct ml_memory *mem;
} ml_st_tensor;

/* All functions return 0 on success, -1 with a message in err otherwise. */

/* Open and validate the file at path; its data is then read with
 * ml_st_read. *f is always left in a state ml_st_close accepts. */
int ml_st_open(ml_st_file *f, const char *path, char *err, size_t errlen);
/* Validate a whole file held in memory (label names it in messages). Data
 * offsets refer to buf + f->data_start. */
int ml_st_parse(ml_st_file *f, const char *label, const void *buf, size_t len,
                char *err, size_t errlen);
/* Read entry i's end - begin bytes into dst (an opened file only). */
int ml_st_read(const ml_st_file *f, size_t i, void *dst, char *err, size_t errlen);
/* Read bytes [off, off + n) of entry i into dst (inside the entry). */
int ml_st_read_range(const ml_st_file *f, size_t i, uint64_t off, size_t n, void *dst, char *err,
                     size_t errlen);
/* Release everything; idempotent; a zeroed struct with fd -1 is closed. */
void ml_st_close(ml_st_file *f);
/* Zero *f with fd -1: the state ml_st_close accepts. */
void ml_st_init(ml_st_file *f);

/* Write n tensors and metadata pairs (meta_kv[2i] = key, meta_kv[2i+1] =
 * value, nmeta pairs; a "format" key replaces the default "pt") to path,
 * atomically. Names must be unique, valid UTF-8, without NUL, and not
 * "__metadata__". */
int ml_st_write(const char *path, const ml_st_tensor *ts, size_t n,
                const char *const *meta_kv, size_t nmeta, char *err, size_t errlen);
/* The same for tensors that may live on a device: their bytes are copied to
 * the host stage (stage_len > 0 bytes) and written one stage at a time. */
int ml_st_write_staged(const char *path, const ml_st_tensor *ts, size_t n,
                       const char *const *meta_kv, size_t nmeta, void *stage, size_t stage_len,
                       char *err, size_t errlen);

/* ---- writing by ranges ---- */

/* The file ml_st_write would write for these tensors (their data is not
 * used and may be NULL) and metadata, without its data: *f gets the
 * entries as ml_st_open will read them back (sorted by data offset, fd -1,
 * label `label`), *header (malloc'd, the caller frees it) the file's
 * first f->data_start bytes. Refuses what ml_st_write refuses. */
int ml_st_layout(ml_st_file *f, uint8_t **header, const char *label, const ml_st_tensor *ts,
                 size_t n, const char *const *meta_kv, size_t nmeta, char *err, size_t errlen);
/* Create (or truncate) path with the layout of ts and metadata, sized to
 * its final length, and leave *f open on it for writing ranges (and
 * reading them). Data not yet written reads as zeros. */
int ml_st_create(ml_st_file *f, const char *path, const ml_st_tensor *ts, size_t n,
                 const char *const *meta_kv, size_t nmeta, char *err, size_t errlen);
/* Open an existing file, validated as ml_st_open validates it, for
 * writing ranges (and reading). */
int ml_st_open_rw(ml_st_file *f, const char *path, char *err, size_t errlen);
/* Write elements [off, off + n) of entry i (in the entry's dtype) from src. */
int ml_st_write_range(const ml_st_file *f, size_t i, uint64_t off, uint64_t n, const void *src,
                      char *err, size_t errlen);
/* fsync the open file. */
int ml_st_sync(const ml_st_file *f, char *err, size_t errlen);

/* "F32", "BF16", ... as the format spells them. */
extern const char *const ml_st_dtype_names[ML_NDTYPES];

#endif
