/*
 * host/runtime/unit.c - flat units: the segment table, partitions and
 * pieces (unit.h). Nothing here knows Lua or allocates a tensor.
 */
#include "unit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A name for a unit or a segment: 1 to ML_UNIT_NAME - 1 chars. */
static int name_ok(const char *name)
{
    return name && name[0] && strlen(name) < ML_UNIT_NAME;
}

ml_status ml_unit_init(ml_unit *u, const char *name, ml_err *e)
{
    memset(u, 0, sizeof *u);
    if (!name_ok(name))
        return ml_err_set(e, ML_EINVAL, "a unit name must have 1 to %d characters",
                          ML_UNIT_NAME - 1);
    strcpy(u->name, name);
    return ML_OK;
}

void ml_unit_free(ml_unit *u)
{
    free(u->seg);
    memset(u, 0, sizeof *u);
}

int ml_unit_find(const ml_unit *u, const char *name)
{
    for (int i = 0; i < u->nseg; i++)
        if (strcmp(u->seg[i].name, name) == 0)
            return i;
    return -1;
}

/* The checks of ml_unit_add on the segment alone; its numel into *n. */
static ml_status check_segment(const ml_unit *u, const ml_segment *s, int64_t *n, ml_err *e)
{
    if (!name_ok(s->name))
        return ml_err_set(e, ML_EINVAL, "a segment name must have 1 to %d characters",
                          ML_UNIT_NAME - 1);
    if (ml_unit_find(u, s->name) >= 0)
        return ml_err_set(e, ML_EINVAL, "segment '%s' appears twice", s->name);
    if (s->ndim < 0 || s->ndim > ML_MAXDIM)
        return ml_err_set(e, ML_EINVAL, "segment '%s': %d dims, at most %d are supported",
                          s->name, s->ndim, ML_MAXDIM);
    for (int d = 0; d < s->ndim; d++)
        if (s->shape[d] < 1)
            return ml_err_set(e, ML_EINVAL, "segment '%s': size of dim %d must be >= 1, got %lld",
                              s->name, d + 1, (long long)s->shape[d]);
    *n = ml_shape_numel(s->ndim, s->shape);
    if (*n < 0 || *n > INT64_MAX - u->numel)
        return ml_err_set(e, ML_EINVAL, "segment '%s': the unit would have more than %lld "
                          "elements", s->name, (long long)INT64_MAX);
    if (!isnan(s->weight_decay) && !(isfinite(s->weight_decay) && s->weight_decay >= 0))
        return ml_err_set(e, ML_EINVAL, "segment '%s': weight_decay must be finite and >= 0, "
                          "got %g", s->name, s->weight_decay);
    if (!(isfinite(s->lr_mult) && s->lr_mult >= 0))
        return ml_err_set(e, ML_EINVAL, "segment '%s': lr_mult must be finite and >= 0, got %g",
                          s->name, s->lr_mult);
    if (s->experts && (s->ndim < 1 || s->experts != s->shape[0]))
        return ml_err_set(e, ML_EINVAL, "segment '%s': experts must be 0 or the size of dim 1 "
                          "(%lld), got %d", s->name, s->ndim ? (long long)s->shape[0] : 0LL,
                          s->experts);
    return ML_OK;
}

ml_status ml_unit_add(ml_unit *u, const ml_segment *proto, ml_err *e)
{
    int64_t n = 0;
    ML_TRY(check_segment(u, proto, &n, e));
    if (u->nseg == u->cap) {
        int cap = u->cap ? 2 * u->cap : 8;
        ml_segment *seg = realloc(u->seg, (size_t)cap * sizeof *seg);
        if (!seg)
            return ml_err_set(e, ML_EALLOC, "out of memory for the segment table of unit %s",
                              u->name);
        u->seg = seg;
        u->cap = cap;
    }
    ml_segment *s = &u->seg[u->nseg++];
    *s = *proto;
    s->offset = u->numel;
    s->numel = n;
    u->numel += n;
    return ML_OK;
}

void ml_partition_of(int64_t numel, int rank, int world, ml_partition *p)
{
    p->shard = numel / world + (numel % world != 0);
    p->padded = p->shard * world;
    p->offset = p->shard * rank;
    int64_t left = numel - p->offset;
    p->len = left < 0 ? 0 : left < p->shard ? left : p->shard;
}

int ml_unit_pieces(const ml_unit *u, int64_t off, int64_t len, ml_piece *out, int max)
{
    int count = 0;
    for (int i = 0; i < u->nseg; i++) {
        const ml_segment *s = &u->seg[i];
        int64_t lo = off > s->offset ? off : s->offset;
        int64_t hi_range = off + len, hi_seg = s->offset + s->numel;
        int64_t hi = hi_range < hi_seg ? hi_range : hi_seg;
        if (lo >= hi)
            continue;
        if (count < max)
            out[count] = (ml_piece){i, lo, lo - s->offset, hi - lo};
        count++;
    }
    return count;
}
