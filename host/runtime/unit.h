/*
 * host/runtime/unit.h - flat units (DESIGN.md, Parameters: flat units): one
 * segment table per unit (name, offset, shape, weight decay, lr
 * multiplier, frozen, expert stride), the layout that its parameters, its
 * gradients and each optimizer state share as one flat buffer apiece;
 * partitions of a unit into equal, padded shards over (rank, world); and
 * the pieces of a range, segment by segment, from which the optimizer
 * builds its shard groups and checkpoints their ranges.
 *
 * Offsets and sizes count elements, never bytes: a unit has no dtype.
 * Not here: the buffers themselves and their views (the Lua binding
 * host/bindings/l_unit.c views a flat tensor; host/runtime/ops_view.h),
 * collectives, the optimizer.
 */
#ifndef ML_UNIT_H
#define ML_UNIT_H

#include "op.h"

#define ML_UNIT_NAME 96   /* names of units and segments: at most 95 chars */

typedef struct {
    char name[ML_UNIT_NAME];
    int64_t offset, numel;      /* elements within the unit */
    int ndim;
    int64_t shape[ML_MAXDIM];
    double weight_decay;        /* NAN: the optimizer's default */
    double lr_mult;             /* 1 by default */
    int frozen;
    int experts;                /* 0: not per expert; E: shape[0] is E experts,
                                   each a contiguous slice of numel / E elements */
} ml_segment;

typedef struct {
    char name[ML_UNIT_NAME];
    int nseg, cap;
    ml_segment *seg;            /* [nseg], in offset order */
    int64_t numel;              /* the sum of the segments' */
} ml_unit;

/* A shard of a unit: [offset, offset + shard) of the padded buffer; len
 * of those elements lie inside the unit (fewer on the last ranks, maybe 0). */
typedef struct {
    int64_t shard;              /* ceil(numel / world) */
    int64_t padded;             /* shard * world */
    int64_t offset;             /* rank * shard */
    int64_t len;
} ml_partition;

/* The part of a range that lies in one segment. */
typedef struct {
    int seg;                    /* index into u->seg */
    int64_t offset;             /* in the unit */
    int64_t seg_offset;         /* in the segment */
    int64_t n;
} ml_piece;

/* An empty unit named `name` (ML_EINVAL: empty or longer than 95 chars;
 * u is then empty and ml_unit_free is still fine). */
ml_status ml_unit_init(ml_unit *u, const char *name, ml_err *e);
void ml_unit_free(ml_unit *u);
/* Append a copy of *proto at the unit's end (its offset and numel are
 * computed; the rest is taken as given). ML_EINVAL, with a message naming
 * the segment, when the name is empty, too long or already there; a size
 * is < 1 or ndim is outside 0..ML_MAXDIM; the unit's numel would
 * overflow int64; weight_decay is neither NAN nor finite >= 0; lr_mult is
 * not finite >= 0; experts is neither 0 nor shape[0]. ML_EALLOC when the
 * table cannot grow. A refused segment leaves u unchanged. */
ml_status ml_unit_add(ml_unit *u, const ml_segment *proto, ml_err *e);
/* The index of the segment named `name`, or -1. */
int ml_unit_find(const ml_unit *u, const char *name);

/* Rank `rank`'s shard of a unit of numel elements over world ranks
 * (0 <= rank < world; the caller checks). */
void ml_partition_of(int64_t numel, int rank, int world, ml_partition *p);
/* The intersections of [off, off + len) with each segment, in order: the
 * first `max` of them into out; returns how many there are (it may exceed
 * max). Elements outside [0, numel) (padding) belong to no segment. */
int ml_unit_pieces(const ml_unit *u, int64_t off, int64_t len, ml_piece *out, int max);

#endif
