/*
 * host/bindings/l_io.c - the Lua library `moelua.io`: tables of named tensors to and
 * from safetensors files (host/runtime/safetensors.c does the format).
 *
 *   io.save(path, {["w"] = t, ...} [, {key = "value", ...}])
 *   local tensors, metadata = io.load(path)
 *   local r <close> = io.open(path)   -- an open file, read entry by entry:
 *   r:entries()                       -- {name = {name =, dtype = "f32", shape = {...}, numel =}, ...}
 *   r:metadata()                      -- {key = value, ...}
 *   r:read_into(name, dst)            -- entry -> dst (any device; float dtypes convert),
 *                                        through bounded host stages (host/runtime/ops_io.h)
 *   r:read_range(name, elem_offset, dst)  -- elements [elem_offset, + numel(dst)) of the
 *                                        entry -> dst, reading only those bytes
 *   r:close()
 *
 * A file written by element ranges, by several processes at once (a
 * sharded checkpoint: each rank writes the ranges it owns); once every
 * range is written it is the file io.save writes for the same tensors:
 *   local w <close> = io.create(path, {{name =, dtype = "f32", shape = {...}}, ...}
 *                               [, {key = "value", ...}])
 *                                     -- ONE process: writes the header, sizes the file
 *   local w <close> = io.open_writer(path)  -- the others, once create returned
 *   w:write_range(name, elem_offset, t)     -- t (contiguous, any device; float dtypes
 *                                              convert) -> elements [elem_offset, + numel(t))
 *   w:entries()                       -- {{name =, dtype =, shape =, numel =}, ...}, in file order
 *   w:sync()                          -- fsync
 *   w:close()                         -- also <close> and the collector; idempotent
 * Inside a memory plan (moelua.mem.plan, which dry-runs a checkpoint's
 * save) these check their arguments and write nothing: io.create makes no
 * file and its writer checks each range against the layout; io.open_writer
 * opens nothing and its writer, which knows no entries (entries() is
 * empty), checks only the offset and the tensor. r:read_range inside a plan
 * checks and reads nothing (io.open itself is refused there).
 *
 * save takes tensors of any dtype, layout and device (non-contiguous ones
 * are copied to contiguous temporaries on their device first; device bytes
 * go to the file through one host stage of at most STAGE_BYTES, never a
 * host copy of a whole tensor) and replaces the file atomically; load
 * returns CPU tensors of the file's dtypes, allocated through the ledger.
 * Errors name the function ("moelua.load: ...") and are raised only when
 * nothing temporary is unowned: copies are Lua userdata, and the open files
 * are to-be-closed userdata ("moelua.io.Reader", "moelua.io.Writer").
 *
 * Not here: checkpoint directories and which ranges a rank owns
 * (lua/moelua/ckpt.lua).
 */
#include "l_tensor.h"
#include "../runtime/ops_io.h"
#include "../runtime/pool.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define READER_MT "moelua.io.Reader"
#define WRITER_MT "moelua.io.Writer"
/* The host stage of a save with device tensors: big enough to stream at
 * the disk's pace, small beside any model. */
#define STAGE_BYTES ((size_t)8 << 20)

/* The string at idx, which must not contain NUL (C paths and names cannot). */
static const char *check_cstring(lua_State *L, int idx, const char *fn, const char *what)
{
    size_t len;
    if (lua_type(L, idx) != LUA_TSTRING)
        ml_error(L, fn, "%s: expected a string, got %s", what, luaL_typename(L, idx));
    const char *s = lua_tolstring(L, idx, &len);
    if (strlen(s) != len)
        ml_error(L, fn, "%s: contains a NUL byte", what);
    return s;
}

/* The tensor value at the stack top, named `name` in the table argument. */
static ml_tensor *check_entry(lua_State *L, const char *fn, const char *name)
{
    char what[300];
    snprintf(what, sizeof what, "argument #2: tensors['%s']", name);
    return ml_checktensor_named(L, -1, fn, what);
}

/* Pairs of strings, compared by their first (the key). */
static int cmp_key(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Metadata at idx as key/value pointer pairs sorted by key, in a userdata
 * left on the stack; *n gets the number of pairs. */
static const char **check_metadata(lua_State *L, int idx, const char *fn, size_t *n)
{
    *n = 0;
    if (lua_isnoneornil(L, idx)) {
        lua_newuserdatauv(L, 0, 0);
        return NULL;
    }
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #3: expected a table of metadata strings, got %s",
                 luaL_typename(L, idx));
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (lua_type(L, -2) != LUA_TSTRING)
            ml_error(L, fn, "argument #3: metadata keys must be strings, got %s",
                     luaL_typename(L, -2));
        const char *k = check_cstring(L, -2, fn, "argument #3: a metadata key");
        if (lua_type(L, -1) != LUA_TSTRING)
            ml_error(L, fn, "argument #3: metadata['%s']: expected a string, got %s", k,
                     luaL_typename(L, -1));
        check_cstring(L, -1, fn, "argument #3: a metadata value");
        lua_pop(L, 1);
        (*n)++;
    }
    const char **kv = lua_newuserdatauv(L, 2 * *n * sizeof *kv, 0);
    size_t i = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        kv[2 * i] = lua_tostring(L, -2);       /* strings of the table: alive for the call */
        kv[2 * i + 1] = lua_tostring(L, -1);
        i++;
        lua_pop(L, 1);
    }
    qsort(kv, *n, 2 * sizeof *kv, cmp_key);   /* pairs by key: a deterministic header */
    return kv;
}

/* Files hold real bytes: inside a memory plan nothing was computed. */
static void refuse_in_plan(lua_State *L, const char *fn)
{
    if (ml_host_of(L)->planning)
        ml_error(L, fn, "files are not read or written inside a memory plan (moelua.mem.plan)");
}

/* io.save(path, tensors [, metadata]) */
static int l_io_save(lua_State *L)
{
    static const char fn[] = "moelua.save";
    ml_args(L, 3, fn);
    refuse_in_plan(L, fn);
    const char *path = check_cstring(L, 1, fn, "argument #1 (path)");
    if (!lua_istable(L, 2) || ml_testtensor(L, 2))
        ml_error(L, fn, "argument #2: expected a table of name = tensor, got %s",
                 ml_testtensor(L, 2) ? "a tensor" : luaL_typename(L, 2));
    lua_settop(L, 3);

    size_t n = 0, nmeta, device_bytes = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        if (lua_type(L, -2) != LUA_TSTRING)
            ml_error(L, fn, "argument #2: tensor names must be strings, got %s",
                     luaL_typename(L, -2));
        const char *name = check_cstring(L, -2, fn, "argument #2: a tensor name");
        const ml_tensor *t = check_entry(L, fn, name);
        if (t->st->device != ML_CPU && ml_nbytes(t) > device_bytes)
            device_bytes = ml_nbytes(t);
        lua_pop(L, 1);
        n++;
    }
    const char **meta = check_metadata(L, 3, fn, &nmeta);        /* slot 4 */
    ml_st_tensor *ts = lua_newuserdatauv(L, n * sizeof *ts, 0);   /* slot 5 */
    lua_newtable(L);                                              /* slot 6: what ts points into */

    /* A second pass: allocating the copies may run the collector and so a
     * finalizer that changes the table; every name and tensor ts points to is
     * anchored in slot 6, and a count that changed is an error. */
    size_t i = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        if (lua_type(L, -2) != LUA_TSTRING || i == n)
            ml_error(L, fn, "argument #2: the table changed while saving (a finalizer?)");
        const char *name = lua_tostring(L, -2);
        ml_tensor *t = check_entry(L, fn, name);
        lua_pushvalue(L, -2);
        lua_rawseti(L, 6, 2 * (lua_Integer)i + 1);   /* the name */
        if (!ml_is_contiguous(t)) {
            ml_tensor *c = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
            ml_run_copy(L, fn, c, t);
            lua_replace(L, -2);                       /* the copy replaces the value */
            t = c;
        }
        lua_rawseti(L, 6, 2 * (lua_Integer)i + 2);   /* the tensor (or its copy) */
        ts[i].name = name;
        ts[i].dtype = t->dtype;
        ts[i].ndim = t->ndim;
        ts[i].shape = t->shape;
        ts[i].data = ml_numel(t) > 0 ? ml_data(t) : NULL;
        ts[i].mem = t->st->device == ML_CPU ? NULL : t->st->mem;
        i++;
    }
    if (i != n)
        ml_error(L, fn, "argument #2: the table changed while saving (a finalizer?)");

    void *stage = NULL;
    size_t stage_len = device_bytes < STAGE_BYTES ? device_bytes : STAGE_BYTES;
    if (stage_len) {
        int64_t len = (int64_t)stage_len;
        stage = ml_data(ml_newtensor(L, fn, ML_CPU, ML_U8, 1, &len));   /* slot 7 */
    }
    char err[1024];
    if (ml_st_write_staged(path, ts, i, meta, nmeta, stage, stage_len, err, sizeof err))
        ml_error(L, fn, "%s", err);
    return 0;
}

/* __gc and __close of a reader: idempotent, never raises. */
static int l_io_reader_gc(lua_State *L)
{
    ml_st_file *f = luaL_testudata(L, 1, READER_MT);
    if (f)
        ml_st_close(f);
    return 0;
}

static int l_io_reader_close(lua_State *L)
{
    ml_args(L, 1, "Reader:close");
    return l_io_reader_gc(L);
}

/* The open reader at idx (closed: an error naming fn). */
static ml_st_file *check_reader(lua_State *L, int idx, const char *fn)
{
    ml_st_file *f = luaL_checkudata(L, idx, READER_MT);
    if (f->fd < 0)
        ml_error(L, fn, "the file is closed");
    return f;
}

/* io.open(path) -> reader */
static int l_io_open(lua_State *L)
{
    static const char fn[] = "moelua.io.open";
    ml_args(L, 1, fn);
    refuse_in_plan(L, fn);
    const char *path = check_cstring(L, 1, fn, "argument #1 (path)");
    char err[1024];
    ml_st_file *f = lua_newuserdatauv(L, sizeof *f, 0);
    ml_st_init(f);                                                /* the safe state first */
    luaL_setmetatable(L, READER_MT);
    if (ml_st_open(f, path, err, sizeof err))
        ml_error(L, fn, "%s", err);
    return 1;
}

/* Push {name =, dtype =, shape =, numel =} of entry e. */
static void push_entry(lua_State *L, const ml_st_entry *e)
{
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e->name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, ml_dtype_names[e->dtype]);
    lua_setfield(L, -2, "dtype");
    lua_createtable(L, e->ndim, 0);
    for (int d = 0; d < e->ndim; d++) {
        lua_pushinteger(L, (lua_Integer)e->shape[d]);
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    ml_setfield_int(L, "numel", (lua_Integer)ml_shape_numel(e->ndim, e->shape));
}

static int l_io_reader_entries(lua_State *L)
{
    ml_args(L, 1, "Reader:entries");
    ml_st_file *f = check_reader(L, 1, "Reader:entries");
    lua_createtable(L, 0, f->nentries > INT_MAX ? INT_MAX : (int)f->nentries);
    for (size_t i = 0; i < f->nentries; i++) {
        push_entry(L, &f->entries[i]);
        lua_setfield(L, -2, f->entries[i].name);
    }
    return 1;
}

/* The index of the entry `name` of f (argument #1 of a method): an error
 * naming fn when there is none. */
static size_t check_name(lua_State *L, int idx, const ml_st_file *f, const char *fn)
{
    const char *name = check_cstring(L, idx, fn, "argument #1 (name)");
    for (size_t i = 0; i < f->nentries; i++)
        if (strcmp(f->entries[i].name, name) == 0)
            return i;
    ml_error(L, fn, "%s has no tensor '%s'", f->label, name);
}

/* An element offset (argument #2 of a method): an integer >= 0. */
static int64_t check_offset(lua_State *L, int idx, const char *fn)
{
    lua_Integer v;
    const char *got = ml_not_integer(L, idx, &v);
    if (got)
        ml_error(L, fn, "argument #2 (elem_offset): expected an integer, got %s", got);
    if (v < 0)
        ml_error(L, fn, "argument #2 (elem_offset) is negative (%lld)", (long long)v);
    return (int64_t)v;
}

static int l_io_reader_metadata(lua_State *L)
{
    ml_args(L, 1, "Reader:metadata");
    ml_st_file *f = check_reader(L, 1, "Reader:metadata");
    lua_createtable(L, 0, f->nmeta > INT_MAX ? INT_MAX : (int)f->nmeta);
    for (size_t i = 0; i < f->nmeta; i++) {
        lua_pushstring(L, f->meta[i].value);
        lua_setfield(L, -2, f->meta[i].key);
    }
    return 1;
}

/* r:read_into(name, dst) -> dst */
static int l_io_reader_read_into(lua_State *L)
{
    static const char fn[] = "Reader:read_into";
    ml_args(L, 3, fn);
    ml_st_file *f = check_reader(L, 1, fn);
    size_t i = check_name(L, 2, f, fn);
    ml_tensor *dst = ml_checktensor_named(L, 3, fn, "argument #2 (dst)");
    ml_err e;
    ml_check_op(L, fn, ml_op_read_entry(ml_host_of(L), dst, f, i, &e), &e);
    lua_settop(L, 3);
    return 1;
}

/* r:read_range(name, elem_offset, dst) -> dst */
static int l_io_reader_read_range(lua_State *L)
{
    static const char fn[] = "Reader:read_range";
    ml_args(L, 4, fn);
    ml_st_file *f = check_reader(L, 1, fn);
    size_t i = check_name(L, 2, f, fn);
    int64_t off = check_offset(L, 3, fn);
    ml_tensor *dst = ml_checktensor_named(L, 4, fn, "argument #3 (dst)");
    ml_err e;
    ml_check_op(L, fn, ml_op_read_range(ml_host_of(L), dst, f, i, off, &e), &e);
    lua_settop(L, 4);
    return 1;
}

/* ---- writers ------------------------------------------------------------ */

/* A file written by ranges. Inside a plan f holds io.create's layout, or
 * nothing (io.open_writer: `blind`), with fd -1. */
typedef struct {
    ml_st_file f;
    int open;      /* 0 once closed */
    int planned;   /* made inside a plan: nothing is written */
    int blind;     /* planned by io.open_writer: no entries known */
} writer;

/* A new writer userdata in the closed (safe) state. */
static writer *push_writer(lua_State *L)
{
    writer *w = lua_newuserdatauv(L, sizeof *w, 0);
    ml_st_init(&w->f);
    w->open = w->planned = w->blind = 0;
    luaL_setmetatable(L, WRITER_MT);
    return w;
}

/* __gc and __close of a writer: idempotent, never raises. */
static int l_io_writer_gc(lua_State *L)
{
    writer *w = luaL_testudata(L, 1, WRITER_MT);
    if (w) {
        ml_st_close(&w->f);
        w->open = 0;
    }
    return 0;
}

static int l_io_writer_close(lua_State *L)
{
    ml_args(L, 1, "Writer:close");
    return l_io_writer_gc(L);
}

static writer *check_writer(lua_State *L, int idx, const char *fn)
{
    writer *w = luaL_checkudata(L, idx, WRITER_MT);
    if (!w->open)
        ml_error(L, fn, "the writer is closed");
    return w;
}

/* The spec at the stack top, tensors[i] of io.create, into *t (its name
 * points into the spec, anchored by argument #2) and shape. */
static void check_spec(lua_State *L, const char *fn, lua_Integer i, ml_st_tensor *t,
                       int64_t *shape)
{
    char what[96], ctx[160];   /* "argument #2: tensors[i]", and a field of it */
    int spec = lua_gettop(L), next;
    snprintf(what, sizeof what, "argument #2: tensors[%lld]", (long long)i);
    if (!lua_istable(L, spec) || ml_testtensor(L, spec))
        ml_error(L, fn, "%s: expected a table {name =, dtype =, shape =}, got %s", what,
                 ml_testtensor(L, spec) ? "a tensor" : luaL_typename(L, spec));
    lua_getfield(L, spec, "name");
    snprintf(ctx, sizeof ctx, "%s.name", what);
    t->name = check_cstring(L, -1, fn, ctx);
    lua_getfield(L, spec, "dtype");
    if (lua_type(L, -1) != LUA_TSTRING)
        ml_error(L, fn, "%s.dtype: expected a string, got %s", what, luaL_typename(L, -1));
    int dt = ml_dtype_from_name(lua_tostring(L, -1));
    if (dt < 0)
        ml_error(L, fn, "%s.dtype: unknown dtype '%s' (f32, f64, bf16, f16, i32, i64, u8)", what,
                 lua_tostring(L, -1));
    lua_getfield(L, spec, "shape");
    if (!lua_istable(L, -1) || ml_testtensor(L, -1))
        ml_error(L, fn, "%s.shape: expected a table of sizes, got %s", what,
                 ml_testtensor(L, -1) ? "a tensor" : luaL_typename(L, -1));
    snprintf(ctx, sizeof ctx, "%s: %s.shape", fn, what);   /* ml_checkshape's "function" */
    t->ndim = ml_checkshape(L, lua_gettop(L), ctx, shape, &next);
    t->dtype = (ml_dtype)dt;
    t->shape = shape;
    t->data = NULL;
    t->mem = NULL;
    lua_settop(L, spec);
}

/* io.create(path, {{name =, dtype =, shape =}, ...} [, metadata]) -> writer */
static int l_io_create(lua_State *L)
{
    static const char fn[] = "moelua.io.create";
    ml_args(L, 3, fn);
    const char *path = check_cstring(L, 1, fn, "argument #1 (path)");
    if (!lua_istable(L, 2) || ml_testtensor(L, 2))
        ml_error(L, fn, "argument #2: expected a list of {name =, dtype =, shape =}, got %s",
                 ml_testtensor(L, 2) ? "a tensor" : luaL_typename(L, 2));
    lua_settop(L, 3);
    size_t nmeta, n = (size_t)lua_rawlen(L, 2);
    const char **meta = check_metadata(L, 3, fn, &nmeta);              /* slot 4 */
    ml_st_tensor *ts = lua_newuserdatauv(L, n * sizeof *ts + 1, 0);     /* slot 5 */
    int64_t (*shapes)[ML_MAXDIM] = lua_newuserdatauv(L, n * sizeof *shapes + 1, 0);
    writer *w = push_writer(L);                                         /* slot 7 */
    for (size_t i = 0; i < n; i++) {     /* no allocation from here to the file */
        lua_rawgeti(L, 2, (lua_Integer)i + 1);
        check_spec(L, fn, (lua_Integer)i + 1, &ts[i], shapes[i]);
        lua_pop(L, 1);
    }
    char err[1024];
    w->planned = ml_host_of(L)->planning;
    if (w->planned) {
        uint8_t *header;
        if (ml_st_layout(&w->f, &header, path, ts, n, meta, nmeta, err, sizeof err))
            ml_error(L, fn, "%s", err);
        free(header);
    } else if (ml_st_create(&w->f, path, ts, n, meta, nmeta, err, sizeof err)) {
        ml_error(L, fn, "%s", err);
    }
    w->open = 1;
    return 1;
}

/* io.open_writer(path) -> writer */
static int l_io_open_writer(lua_State *L)
{
    static const char fn[] = "moelua.io.open_writer";
    ml_args(L, 1, fn);
    const char *path = check_cstring(L, 1, fn, "argument #1 (path)");
    writer *w = push_writer(L);
    char err[1024];
    w->planned = w->blind = ml_host_of(L)->planning;
    if (!w->planned && ml_st_open_rw(&w->f, path, err, sizeof err))
        ml_error(L, fn, "%s", err);
    w->open = 1;
    return 1;
}

/* w:write_range(name, elem_offset, t) */
static int l_io_writer_write_range(lua_State *L)
{
    static const char fn[] = "Writer:write_range";
    ml_args(L, 4, fn);
    writer *w = check_writer(L, 1, fn);
    if (w->blind) {
        check_cstring(L, 2, fn, "argument #1 (name)");
        check_offset(L, 3, fn);
        ml_checktensor_named(L, 4, fn, "argument #3 (t)");
        return 0;
    }
    size_t i = check_name(L, 2, &w->f, fn);
    int64_t off = check_offset(L, 3, fn);
    ml_tensor *t = ml_checktensor_named(L, 4, fn, "argument #3 (t)");
    ml_err e;
    ml_check_op(L, fn, ml_op_write_range(ml_host_of(L), &w->f, i, off, t, &e), &e);
    return 0;
}

static int l_io_writer_entries(lua_State *L)
{
    ml_args(L, 1, "Writer:entries");
    writer *w = check_writer(L, 1, "Writer:entries");
    lua_createtable(L, w->f.nentries > INT_MAX ? INT_MAX : (int)w->f.nentries, 0);
    for (size_t i = 0; i < w->f.nentries; i++) {
        push_entry(L, &w->f.entries[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int l_io_writer_sync(lua_State *L)
{
    static const char fn[] = "Writer:sync";
    ml_args(L, 1, fn);
    writer *w = check_writer(L, 1, fn);
    char err[1024];
    if (!w->planned && ml_st_sync(&w->f, err, sizeof err))
        ml_error(L, fn, "%s", err);
    return 0;
}

/* io.load(path) -> tensors, metadata */
static int l_io_load(lua_State *L)
{
    static const char fn[] = "moelua.load";
    ml_args(L, 1, fn);
    refuse_in_plan(L, fn);
    const char *path = check_cstring(L, 1, fn, "argument #1 (path)");
    char err[1024];
    lua_settop(L, 1);

    ml_st_file *f = lua_newuserdatauv(L, sizeof *f, 0);          /* slot 2 */
    ml_st_init(f);                                                /* the safe state first */
    luaL_setmetatable(L, READER_MT);
    lua_toclose(L, 2);                                            /* closed by any error below */
    if (ml_st_open(f, path, err, sizeof err))
        ml_error(L, fn, "%s", err);

    lua_createtable(L, 0, f->nentries > INT_MAX ? INT_MAX : (int)f->nentries);   /* slot 3 */
    for (size_t i = 0; i < f->nentries; i++) {
        const ml_st_entry *e = &f->entries[i];
        ml_tensor *t = ml_newtensor(L, fn, ML_CPU, e->dtype, e->ndim, e->shape);
        if (e->end > e->begin && ml_st_read(f, i, ml_data(t), err, sizeof err))
            ml_error(L, fn, "%s", err);
        lua_setfield(L, 3, e->name);
    }
    lua_createtable(L, 0, f->nmeta > INT_MAX ? INT_MAX : (int)f->nmeta);         /* slot 4 */
    for (size_t i = 0; i < f->nmeta; i++) {
        lua_pushstring(L, f->meta[i].value);
        lua_setfield(L, 4, f->meta[i].key);
    }
    ml_st_close(f);
    return 2;
}

static const luaL_Reg io_functions[] = {
    {"save", l_io_save},
    {"load", l_io_load},
    {"open", l_io_open},
    {"create", l_io_create},
    {"open_writer", l_io_open_writer},
    {NULL, NULL}
};

static const luaL_Reg reader_methods[] = {
    {"entries", l_io_reader_entries},
    {"metadata", l_io_reader_metadata},
    {"read_into", l_io_reader_read_into},
    {"read_range", l_io_reader_read_range},
    {"close", l_io_reader_close},
    {NULL, NULL}
};

static const luaL_Reg writer_methods[] = {
    {"write_range", l_io_writer_write_range},
    {"entries", l_io_writer_entries},
    {"sync", l_io_writer_sync},
    {"close", l_io_writer_close},
    {NULL, NULL}
};

static const luaL_Reg writer_meta[] = {
    {"__gc", l_io_writer_gc},
    {"__close", l_io_writer_gc},
    {NULL, NULL}
};

static const luaL_Reg reader_meta[] = {
    {"__gc", l_io_reader_gc},
    {"__close", l_io_reader_gc},
    {NULL, NULL}
};

int luaopen_moelua_io(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_newmetatable(L, READER_MT);
    luaL_setfuncs(L, reader_meta, 0);
    luaL_newlib(L, reader_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newmetatable(L, WRITER_MT);
    luaL_setfuncs(L, writer_meta, 0);
    luaL_newlib(L, writer_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newlib(L, io_functions);
    return 1;
}
