/*
 * host/runtime/safetensors.c - the safetensors reader and writer (host/runtime/safetensors.h).
 *
 * Reading: the 8-byte header length is bounded by ML_ST_MAX_HEADER and by
 * the file; the header is parsed by a strict pull parser that knows the
 * format's schema (an object of tensor entries and an optional
 * `__metadata__` object of strings), so nesting is bounded by the schema
 * itself: anything deeper is a type error. Strings are decoded (escapes,
 * \uXXXX with surrogate pairs, UTF-8 checked) into one arena no larger than
 * the header. Then the tensors are checked against each other: unique
 * names, offsets that match their shapes, and a data section they tile
 * exactly. Data is read with pread into memory the caller owns.
 *
 * Writing: the header is drafted once (checks, file order, JSON) for both
 * ways to write: a whole file at once (a temporary file renamed into
 * place), or by ranges (ml_st_layout parses its own draft with the reader's
 * parser, so writers see exactly the entries a reader will; ranges are
 * pwritten at their final offsets).
 *
 * Not here: Lua, tensors, allocation of tensor data, general-purpose JSON
 * (true, false, null and fractions are recognised only to name them in
 * an error).
 */
#include "safetensors.h"
#include "backend.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this host is not"
#endif

const char *const ml_st_dtype_names[ML_NDTYPES] = {"F32", "F64", "BF16", "F16", "I32", "I64", "U8"};

#define NAME_SHOWN 80   /* bytes of a name quoted in a message */

static int fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* A name from the file, fit for a message: control bytes become '?', long
 * names are cut with "...". */
static const char *shown(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 4 < len && i < NAME_SHOWN; i++)
        buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    if (s[i]) {
        memcpy(buf + i, "...", 3);
        i += 3;
    }
    buf[i] = '\0';
    return buf;
}

/* Length of the UTF-8 sequence at p (1-4), or 0 if it is malformed:
 * truncated, overlong, a surrogate or beyond U+10FFFF. */
static size_t utf8_seq(const uint8_t *p, const uint8_t *end)
{
    uint8_t c = p[0];
    size_t n;
    uint32_t cp, min;
    if (c < 0x80)
        return 1;
    if ((c & 0xe0) == 0xc0) {
        n = 2; cp = c & 0x1f; min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
        n = 3; cp = c & 0x0f; min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
        n = 4; cp = c & 0x07; min = 0x10000;
    } else {
        return 0;
    }
    if ((size_t)(end - p) < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (p[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return n;
}

static int valid_utf8(const char *s)
{
    const uint8_t *p = (const uint8_t *)s, *end = p + strlen(s);
    while (p < end) {
        size_t n = utf8_seq(p, end);
        if (!n)
            return 0;
        p += n;
    }
    return 1;
}

static uint64_t read_le64(const uint8_t *b)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | b[i];
    return v;
}

/* ---- the JSON pull parser --------------------------------------------- */

typedef struct {
    const uint8_t *start, *p, *end;   /* the header bytes */
    const char *label;
    char *arena;                      /* decoded strings, NUL-terminated */
    size_t used;
    char *err;
    size_t errlen;
} jparser;

static int syntax(jparser *J, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int semantic(jparser *J, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int syntax(jparser *J, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fail(J->err, J->errlen, "%s: bad JSON in the header at byte %zu: %s", J->label,
                (size_t)(J->p - J->start), msg);
}

static int semantic(jparser *J, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fail(J->err, J->errlen, "%s: %s", J->label, msg);
}

static int peek(const jparser *J)
{
    return J->p < J->end ? *J->p : -1;
}

static void skip_ws(jparser *J)
{
    while (J->p < J->end && (*J->p == ' ' || *J->p == '\t' || *J->p == '\n' || *J->p == '\r'))
        J->p++;
}

/* What a JSON value starting with c is, for messages; NULL: no value starts so. */
static const char *kind_of(int c)
{
    switch (c) {
    case '{': return "an object";
    case '[': return "an array";
    case '"': return "a string";
    case 't': case 'f': return "a boolean";
    case 'n': return "null";
    default:  return c == '-' || (c >= '0' && c <= '9') ? "a number" : NULL;
    }
}

/* A value of kind `want` was expected at the current position. */
static int wrong_kind(jparser *J, const char *ctx, const char *want)
{
    int c = peek(J);
    const char *got = kind_of(c);
    if (!got)
        return c < 0 ? syntax(J, "unexpected end of the header")
                     : syntax(J, "unexpected character '%c' (0x%02x)", c >= 0x20 && c < 0x7f ? c : '?', c);
    return semantic(J, "%s must be %s, got %s", ctx, want, got);
}

/* Consume the structural character ch (after whitespace). */
static int expect(jparser *J, int ch)
{
    skip_ws(J);
    if (peek(J) != ch) {
        int c = peek(J);
        if (c < 0)
            return syntax(J, "expected '%c', got the end of the header", ch);
        return syntax(J, "expected '%c', got '%c'", ch, c >= 0x20 && c < 0x7f ? c : '?');
    }
    J->p++;
    return 0;
}

/* After a member or element: 1 if another follows (','), 0 at `close`. */
static int next_or_close(jparser *J, int close)
{
    skip_ws(J);
    int c = peek(J);
    if (c == ',') {
        J->p++;
        return 1;
    }
    if (c == close) {
        J->p++;
        return 0;
    }
    if (c < 0)
        return syntax(J, "expected ',' or '%c', got the end of the header", close);
    return syntax(J, "expected ',' or '%c', got '%c'", close, c >= 0x20 && c < 0x7f ? c : '?');
}

static int hex4(jparser *J, uint32_t *out)
{
    uint32_t v = 0;
    if (J->end - J->p < 4)
        return syntax(J, "truncated \\u escape");
    for (int i = 0; i < 4; i++) {
        int c = J->p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return syntax(J, "bad hex digit in a \\u escape");
        v = v << 4 | (uint32_t)d;
    }
    J->p += 4;
    *out = v;
    return 0;
}

static char *put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xc0 | cp >> 6);
        *o++ = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        *o++ = (char)(0xe0 | cp >> 12);
        *o++ = (char)(0x80 | (cp >> 6 & 0x3f));
        *o++ = (char)(0x80 | (cp & 0x3f));
    } else {
        *o++ = (char)(0xf0 | cp >> 18);
        *o++ = (char)(0x80 | (cp >> 12 & 0x3f));
        *o++ = (char)(0x80 | (cp >> 6 & 0x3f));
        *o++ = (char)(0x80 | (cp & 0x3f));
    }
    return o;
}

/* A \u escape (the "\u" consumed): one code point, pairing surrogates. */
static int unicode_escape(jparser *J, uint32_t *cp)
{
    uint32_t hi, lo;
    if (hex4(J, &hi))
        return -1;
    if (hi >= 0xdc00 && hi <= 0xdfff)
        return syntax(J, "unpaired low surrogate \\u%04x", (unsigned)hi);
    if (hi >= 0xd800 && hi <= 0xdbff) {
        if (J->end - J->p < 2 || J->p[0] != '\\' || J->p[1] != 'u')
            return syntax(J, "unpaired high surrogate \\u%04x", (unsigned)hi);
        J->p += 2;
        if (hex4(J, &lo))
            return -1;
        if (lo < 0xdc00 || lo > 0xdfff)
            return syntax(J, "high surrogate \\u%04x followed by \\u%04x", (unsigned)hi,
                          (unsigned)lo);
        hi = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
    }
    if (hi == 0)
        return syntax(J, "\\u0000 in a string is not supported");
    *cp = hi;
    return 0;
}

/* The string at the current position (its '"' not yet consumed), decoded
 * into the arena. Output never outgrows input: the arena cannot overflow. */
static int parse_string(jparser *J, const char **out)
{
    char *o = J->arena + J->used, *begin = o;
    J->p++;
    for (;;) {
        if (J->p >= J->end)
            return syntax(J, "unterminated string");
        uint8_t c = *J->p;
        if (c == '"') {
            J->p++;
            break;
        }
        if (c < 0x20)
            return syntax(J, "control character 0x%02x in a string", c);
        if (c == '\\') {
            if (J->end - J->p < 2)
                return syntax(J, "unterminated string");
            c = J->p[1];
            J->p += 2;
            switch (c) {
            case '"': case '\\': case '/': *o++ = (char)c; break;
            case 'b': *o++ = '\b'; break;
            case 'f': *o++ = '\f'; break;
            case 'n': *o++ = '\n'; break;
            case 'r': *o++ = '\r'; break;
            case 't': *o++ = '\t'; break;
            case 'u': {
                uint32_t cp = 0;
                if (unicode_escape(J, &cp))
                    return -1;
                o = put_utf8(o, cp);
                break;
            }
            default:
                J->p--;
                return syntax(J, "invalid escape '\\%c'", c >= 0x20 && c < 0x7f ? c : '?');
            }
            continue;
        }
        size_t n = utf8_seq(J->p, J->end);
        if (!n)
            return syntax(J, "invalid UTF-8 in a string");
        memcpy(o, J->p, n);
        o += n;
        J->p += n;
    }
    *o++ = '\0';
    J->used = (size_t)(o - J->arena);
    *out = begin;
    return 0;
}

/* A member name: '"' expected after whitespace. */
static int parse_key(jparser *J, const char **out)
{
    skip_ws(J);
    if (peek(J) != '"')
        return peek(J) < 0 ? syntax(J, "expected a string key, got the end of the header")
                           : syntax(J, "expected a string key");
    return parse_string(J, out);
}

/* A non-negative integer; ctx names it in messages. */
static int parse_uint(jparser *J, const char *ctx, uint64_t *out)
{
    skip_ws(J);
    int c = peek(J);
    if (c == '-')
        return semantic(J, "%s must be a non-negative integer, got a negative number", ctx);
    if (c < '0' || c > '9')
        return wrong_kind(J, ctx, "a non-negative integer");
    if (c == '0' && J->end - J->p > 1 && J->p[1] >= '0' && J->p[1] <= '9')
        return syntax(J, "leading zero in a number");
    uint64_t v = 0;
    while (J->p < J->end && *J->p >= '0' && *J->p <= '9') {
        unsigned d = (unsigned)(*J->p - '0');
        if (v > (UINT64_MAX - d) / 10)
            return semantic(J, "%s: integer too large (more than 64 bits)", ctx);
        v = v * 10 + d;
        J->p++;
    }
    c = peek(J);
    if (c == '.' || c == 'e' || c == 'E')
        return semantic(J, "%s must be an integer, got a fraction or exponent", ctx);
    *out = v;
    return 0;
}

/* An array of at most max non-negative integers; *n = max + 1 when there
 * are more (parsing stops there). */
static int parse_uint_array(jparser *J, const char *ctx, uint64_t *vals, int max, int *n)
{
    skip_ws(J);
    if (peek(J) != '[')
        return wrong_kind(J, ctx, "an array of integers");
    J->p++;
    *n = 0;
    skip_ws(J);
    if (peek(J) == ']') {
        J->p++;
        return 0;
    }
    for (;;) {
        if (*n == max) {
            *n = max + 1;
            return 0;
        }
        if (parse_uint(J, ctx, &vals[*n]))
            return -1;
        (*n)++;
        int more = next_or_close(J, ']');
        if (more < 0)
            return -1;
        if (!more)
            return 0;
    }
}

/* ---- the schema ------------------------------------------------------- */

typedef struct {
    ml_st_file *f;
    size_t cap_entries, cap_meta;
    uint64_t data_size;
} builder;

static int grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap * 2 : 16;
    void *p = realloc(*arr, c * elem);
    if (!p)
        return -1;
    *arr = p;
    *cap = c;
    return 0;
}

static void format_dims(char *buf, size_t len, int n, const uint64_t *v)
{
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, i ? ",%llu" : "%llu", (unsigned long long)v[i]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
}

static int parse_metadata(jparser *J, builder *B)
{
    ml_st_file *f = B->f;
    char nb[NAME_SHOWN + 8];
    skip_ws(J);
    if (peek(J) != '{')
        return wrong_kind(J, "'__metadata__'", "an object of strings");
    J->p++;
    skip_ws(J);
    if (peek(J) == '}') {
        J->p++;
        return 0;
    }
    for (;;) {
        const char *key, *value;
        if (parse_key(J, &key) || expect(J, ':'))
            return -1;
        skip_ws(J);
        if (peek(J) != '"') {
            char ctx[NAME_SHOWN + 32];
            snprintf(ctx, sizeof ctx, "metadata '%s'", shown(key, nb, sizeof nb));
            return wrong_kind(J, ctx, "a string");
        }
        if (parse_string(J, &value))
            return -1;
        void *arr = f->meta;
        if (grow(&arr, &B->cap_meta, f->nmeta + 1, sizeof *f->meta))
            return semantic(J, "out of memory reading the header");
        f->meta = arr;
        f->meta[f->nmeta].key = key;
        f->meta[f->nmeta].value = value;
        f->nmeta++;
        int more = next_or_close(J, '}');
        if (more <= 0)
            return more;
    }
}

enum { HAVE_DTYPE = 1, HAVE_SHAPE = 2, HAVE_OFFSETS = 4 };

/* Checks of one entry on its own: sizes, overflow, offsets vs shape. */
static int check_entry(jparser *J, const ml_st_entry *e, const uint64_t *dims, const char *nm,
                       uint64_t data_size)
{
    char sh[ML_MAXDIM * 22 + 4];
    format_dims(sh, sizeof sh, e->ndim, dims);
    uint64_t numel = 1, esize = ml_dtype_size(e->dtype);
    for (int i = 0; i < e->ndim; i++)
        if (dims[i] > (uint64_t)INT64_MAX)
            return semantic(J, "tensor '%s': shape %s has too many elements", nm, sh);
    for (int i = 0; i < e->ndim; i++) {
        if (dims[i] == 0) {
            numel = 0;
            break;
        }
    }
    for (int i = 0; i < e->ndim && numel; i++) {
        if (numel > (uint64_t)INT64_MAX / dims[i])
            return semantic(J, "tensor '%s': shape %s has too many elements", nm, sh);
        numel *= dims[i];
    }
    if (numel > UINT64_MAX / esize)
        return semantic(J, "tensor '%s': shape %s has too many elements", nm, sh);
    uint64_t nbytes = numel * esize;
    if (e->end < e->begin)
        return semantic(J, "tensor '%s': data_offsets [%llu,%llu] end before they begin", nm,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end - e->begin != nbytes)
        return semantic(J, "tensor '%s': data_offsets [%llu,%llu] do not match shape %s of %s "
                        "(%llu bytes)", nm, (unsigned long long)e->begin,
                        (unsigned long long)e->end, sh, ml_st_dtype_names[e->dtype],
                        (unsigned long long)nbytes);
    if (e->end > data_size)
        return semantic(J, "tensor '%s': data_offsets [%llu,%llu] run past the end of the data "
                        "section (%llu bytes)", nm, (unsigned long long)e->begin,
                        (unsigned long long)e->end, (unsigned long long)data_size);
    return 0;
}

static int parse_entry(jparser *J, builder *B, const char *name)
{
    ml_st_file *f = B->f;
    char nb[NAME_SHOWN + 8], ctx[NAME_SHOWN + 64];
    const char *nm = shown(name, nb, sizeof nb);
    uint64_t dims[ML_MAXDIM], offs[2];
    int have = 0, n;
    ml_st_entry e;
    memset(&e, 0, sizeof e);
    e.name = name;

    skip_ws(J);
    if (peek(J) != '{') {
        snprintf(ctx, sizeof ctx, "tensor '%s'", nm);
        return wrong_kind(J, ctx, "an object");
    }
    J->p++;
    skip_ws(J);
    if (peek(J) == '}')
        J->p++;
    else for (;;) {
        const char *key;
        int bit;
        if (parse_key(J, &key) || expect(J, ':'))
            return -1;
        if (strcmp(key, "dtype") == 0) bit = HAVE_DTYPE;
        else if (strcmp(key, "shape") == 0) bit = HAVE_SHAPE;
        else if (strcmp(key, "data_offsets") == 0) bit = HAVE_OFFSETS;
        else {
            char kb[NAME_SHOWN + 8];
            return semantic(J, "tensor '%s': unknown key '%s'", nm, shown(key, kb, sizeof kb));
        }
        if (have & bit)
            return semantic(J, "tensor '%s': duplicate key '%s'", nm, key);
        have |= bit;
        snprintf(ctx, sizeof ctx, "tensor '%s': %s", nm, key);
        if (bit == HAVE_DTYPE) {
            const char *dt;
            skip_ws(J);
            if (peek(J) != '"')
                return wrong_kind(J, ctx, "a string");
            if (parse_string(J, &dt))
                return -1;
            int i = 0;
            while (i < ML_NDTYPES && strcmp(dt, ml_st_dtype_names[i]) != 0)
                i++;
            if (i == ML_NDTYPES) {
                char db[NAME_SHOWN + 8];
                return semantic(J, "tensor '%s': dtype %s is not supported (F32, F64, BF16, F16, "
                                "I32, I64, U8)", nm, shown(dt, db, sizeof db));
            }
            e.dtype = (ml_dtype)i;
        } else if (bit == HAVE_SHAPE) {
            if (parse_uint_array(J, ctx, dims, ML_MAXDIM, &n))
                return -1;
            if (n > ML_MAXDIM)
                return semantic(J, "tensor '%s': shape has more than %d dims", nm, ML_MAXDIM);
            e.ndim = n;
        } else {
            if (parse_uint_array(J, ctx, offs, 2, &n))
                return -1;
            if (n != 2)
                return semantic(J, "tensor '%s': data_offsets must be [begin, end], got %s "
                                "integers", nm, n > 2 ? "more than 2" : n == 1 ? "1" : "0");
            e.begin = offs[0];
            e.end = offs[1];
        }
        int more = next_or_close(J, '}');
        if (more < 0)
            return -1;
        if (!more)
            break;
    }
    if (!(have & HAVE_DTYPE))
        return semantic(J, "tensor '%s': missing 'dtype'", nm);
    if (!(have & HAVE_SHAPE))
        return semantic(J, "tensor '%s': missing 'shape'", nm);
    if (!(have & HAVE_OFFSETS))
        return semantic(J, "tensor '%s': missing 'data_offsets'", nm);
    if (check_entry(J, &e, dims, nm, B->data_size))
        return -1;
    for (int i = 0; i < e.ndim; i++)
        e.shape[i] = (int64_t)dims[i];
    void *arr = f->entries;
    if (grow(&arr, &B->cap_entries, f->nentries + 1, sizeof *f->entries))
        return semantic(J, "out of memory reading the header");
    f->entries = arr;
    f->entries[f->nentries++] = e;
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_offset(const void *a, const void *b)
{
    const ml_st_entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Sorted copy of n strings taken at stride from base; the first repeated
 * one, or NULL. *oom set when the copy cannot be made. */
static const char *first_duplicate(const void *base, size_t n, size_t stride, int *oom)
{
    const char *dup = NULL;
    *oom = 0;
    if (n < 2)
        return NULL;
    const char **v = malloc(n * sizeof *v);
    if (!v) {
        *oom = 1;
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        v[i] = *(const char *const *)((const char *)base + i * stride);
    qsort(v, n, sizeof *v, cmp_str);
    for (size_t i = 1; i < n && !dup; i++)
        if (strcmp(v[i - 1], v[i]) == 0)
            dup = v[i];
    free(v);
    return dup;
}

/* Tensors sorted by offset must tile [0, data_size) exactly. */
static int check_layout(jparser *J, ml_st_file *f, uint64_t data_size)
{
    char nb[NAME_SHOWN + 8], pb[NAME_SHOWN + 8];
    uint64_t at = 0;
    const ml_st_entry *prev = NULL;
    if (f->nentries > 1)
        qsort(f->entries, f->nentries, sizeof *f->entries, cmp_offset);
    for (size_t i = 0; i < f->nentries; i++) {
        const ml_st_entry *e = &f->entries[i];
        if (e->begin < at)
            return semantic(J, "tensor '%s': data_offsets [%llu,%llu] overlap tensor '%s' "
                            "[%llu,%llu]", shown(e->name, nb, sizeof nb),
                            (unsigned long long)e->begin, (unsigned long long)e->end,
                            shown(prev->name, pb, sizeof pb), (unsigned long long)prev->begin,
                            (unsigned long long)prev->end);
        if (e->begin > at) {
            char after[NAME_SHOWN + 32];
            if (prev)
                snprintf(after, sizeof after, "tensor '%s'", shown(prev->name, pb, sizeof pb));
            else
                snprintf(after, sizeof after, "the start of the data section");
            return semantic(J, "tensor '%s': data_offsets [%llu,%llu] leave a gap of %llu bytes "
                            "after %s", shown(e->name, nb, sizeof nb),
                            (unsigned long long)e->begin, (unsigned long long)e->end,
                            (unsigned long long)(e->begin - at), after);
        }
        if (e->end > at || !prev) {
            at = e->end;
            prev = e;
        }
    }
    if (at != data_size)
        return semantic(J, "the tensors cover %llu bytes of the %llu-byte data section "
                        "(%llu trailing bytes)", (unsigned long long)at,
                        (unsigned long long)data_size, (unsigned long long)(data_size - at));
    return 0;
}

/* Parse and check the n header bytes at hdr; fills f's entries, metadata
 * and arena. */
static int parse_header(ml_st_file *f, const char *label, const uint8_t *hdr, size_t n,
                        uint64_t data_size, char *err, size_t errlen)
{
    builder B = {f, 0, 0, data_size};
    jparser J = {hdr, hdr, hdr + n, label, NULL, 0, err, errlen};
    int seen_meta = 0, oom;
    char nb[NAME_SHOWN + 8];
    const char *dup;

    if (!(f->arena = malloc(n + 1)))
        return fail(err, errlen, "%s: out of memory reading a %zu-byte header", label, n);
    J.arena = f->arena;
    skip_ws(&J);
    if (peek(&J) != '{') {
        if (peek(&J) < 0)
            return semantic(&J, "the header is empty");
        return wrong_kind(&J, "the header", "a JSON object");
    }
    J.p++;
    skip_ws(&J);
    if (peek(&J) == '}')
        J.p++;
    else for (;;) {
        const char *key;
        if (parse_key(&J, &key) || expect(&J, ':'))
            return -1;
        if (strcmp(key, "__metadata__") == 0) {
            if (seen_meta)
                return semantic(&J, "duplicate key '__metadata__'");
            seen_meta = 1;
            if (parse_metadata(&J, &B))
                return -1;
        } else if (parse_entry(&J, &B, key)) {
            return -1;
        }
        int more = next_or_close(&J, '}');
        if (more < 0)
            return -1;
        if (!more)
            break;
    }
    skip_ws(&J);
    if (J.p != J.end)
        return syntax(&J, "trailing characters after the header object");

    dup = first_duplicate(f->entries, f->nentries, sizeof *f->entries, &oom);
    if (dup || oom)
        return oom ? semantic(&J, "out of memory reading the header")
                   : semantic(&J, "duplicate tensor name '%s'", shown(dup, nb, sizeof nb));
    dup = first_duplicate(f->meta, f->nmeta, sizeof *f->meta, &oom);
    if (dup || oom)
        return oom ? semantic(&J, "out of memory reading the header")
                   : semantic(&J, "duplicate metadata key '%s'", shown(dup, nb, sizeof nb));
    return check_layout(&J, f, data_size);
}

/* The header length against the limit and the file size. */
static int check_header_len(const char *label, uint64_t hlen, uint64_t file_size, char *err,
                            size_t errlen)
{
    if (hlen > ML_ST_MAX_HEADER)
        return fail(err, errlen, "%s: header length %llu exceeds the limit of %u bytes", label,
                    (unsigned long long)hlen, ML_ST_MAX_HEADER);
    if (hlen > file_size - 8)
        return fail(err, errlen, "%s: header length %llu runs past the end of the file "
                    "(%llu bytes)", label, (unsigned long long)hlen,
                    (unsigned long long)file_size);
    return 0;
}

/* ---- reading ---------------------------------------------------------- */

void ml_st_init(ml_st_file *f)
{
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

void ml_st_close(ml_st_file *f)
{
    if (f->fd >= 0)
        close(f->fd);
    free(f->entries);
    free(f->meta);
    free(f->arena);
    free(f->label);
    ml_st_init(f);
}

static int set_label(ml_st_file *f, const char *label, char *err, size_t errlen)
{
    if (!(f->label = strdup(label)))
        return fail(err, errlen, "out of memory copying the file name");
    return 0;
}

int ml_st_parse(ml_st_file *f, const char *label, const void *buf, size_t len, char *err,
                size_t errlen)
{
    const uint8_t *b = buf;
    ml_st_init(f);
    if (set_label(f, label, err, errlen))
        return -1;
    if (len < 8) {
        fail(err, errlen, "%s: file is %zu bytes, too short for the 8-byte header length", label,
             len);
        goto bad;
    }
    uint64_t hlen = read_le64(b);
    if (check_header_len(label, hlen, len, err, errlen))
        goto bad;
    f->data_start = 8 + hlen;
    f->data_size = len - f->data_start;
    if (parse_header(f, label, b + 8, (size_t)hlen, f->data_size, err, errlen))
        goto bad;
    return 0;
bad:
    ml_st_close(f);
    return -1;
}

/* pread exactly n bytes at off; -1 with errno, or 0 < got < n at EOF. */
static ssize_t pread_full(int fd, void *dst, size_t n, uint64_t off)
{
    size_t got = 0;
    while (got < n) {
        size_t chunk = n - got > (1u << 30) ? (1u << 30) : n - got;
        ssize_t r = pread(fd, (char *)dst + got, chunk, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Open path with `flags` (O_RDONLY or O_RDWR) and validate it. */
static int open_file(ml_st_file *f, const char *path, int flags, char *err, size_t errlen)
{
    uint8_t lenbuf[8], *hdr = NULL;
    struct stat sb;
    ml_st_init(f);
    if (set_label(f, path, err, errlen))
        return -1;
    if ((f->fd = open(path, flags | O_CLOEXEC)) < 0) {
        fail(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        goto bad;
    }
    if (fstat(f->fd, &sb) < 0) {
        fail(err, errlen, "%s: cannot stat: %s", path, strerror(errno));
        goto bad;
    }
    if (!S_ISREG(sb.st_mode)) {
        fail(err, errlen, "%s: not a regular file", path);
        goto bad;
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        fail(err, errlen, "%s: file is %llu bytes, too short for the 8-byte header length", path,
             (unsigned long long)size);
        goto bad;
    }
    ssize_t r = pread_full(f->fd, lenbuf, 8, 0);
    if (r != 8) {
        fail(err, errlen, "%s: cannot read the header length: %s", path,
             r < 0 ? strerror(errno) : "the file ended early");
        goto bad;
    }
    uint64_t hlen = read_le64(lenbuf);
    if (check_header_len(path, hlen, size, err, errlen))
        goto bad;
    if (!(hdr = malloc(hlen ? hlen : 1))) {
        fail(err, errlen, "%s: out of memory reading a %llu-byte header", path,
             (unsigned long long)hlen);
        goto bad;
    }
    r = pread_full(f->fd, hdr, (size_t)hlen, 8);
    if (r != (ssize_t)hlen) {
        fail(err, errlen, "%s: cannot read the header: %s", path,
             r < 0 ? strerror(errno) : "the file ended early");
        goto bad;
    }
    f->data_start = 8 + hlen;
    f->data_size = size - f->data_start;
    if (parse_header(f, path, hdr, (size_t)hlen, f->data_size, err, errlen))
        goto bad;
    free(hdr);
    return 0;
bad:
    free(hdr);
    ml_st_close(f);
    return -1;
}

int ml_st_open(ml_st_file *f, const char *path, char *err, size_t errlen)
{
    return open_file(f, path, O_RDONLY, err, errlen);
}

int ml_st_open_rw(ml_st_file *f, const char *path, char *err, size_t errlen)
{
    if (open_file(f, path, O_RDWR, err, errlen))
        return -1;
    f->writable = 1;
    return 0;
}

static const char *label_of(const ml_st_file *f)
{
    return f->label ? f->label : "safetensors";
}

/* Entry i of the open file f, or NULL with a message. */
static const ml_st_entry *open_entry(const ml_st_file *f, size_t i, char *err, size_t errlen)
{
    if (f->fd < 0) {
        fail(err, errlen, "%s: not an open file", label_of(f));
        return NULL;
    }
    if (i >= f->nentries) {
        fail(err, errlen, "%s: no tensor #%zu", label_of(f), i);
        return NULL;
    }
    return &f->entries[i];
}

int ml_st_read(const ml_st_file *f, size_t i, void *dst, char *err, size_t errlen)
{
    if (f->fd >= 0 && i < f->nentries)
        return ml_st_read_range(f, i, 0, (size_t)(f->entries[i].end - f->entries[i].begin), dst, err,
                                errlen);
    return ml_st_read_range(f, i, 0, 0, dst, err, errlen);
}

int ml_st_read_range(const ml_st_file *f, size_t i, uint64_t off, size_t n, void *dst, char *err,
                     size_t errlen)
{
    char nb[NAME_SHOWN + 8];
    const char *label = label_of(f);
    const ml_st_entry *e = open_entry(f, i, err, errlen);
    if (!e)
        return -1;
    if (off > e->end - e->begin || n > e->end - e->begin - off)
        return fail(err, errlen, "%s: tensor '%s': bytes [%llu, +%zu) are outside its %llu", label,
                    shown(e->name, nb, sizeof nb), (unsigned long long)off, n,
                    (unsigned long long)(e->end - e->begin));
    if (n == 0)
        return 0;
    ssize_t r = pread_full(f->fd, dst, n, f->data_start + e->begin + off);
    if (r != (ssize_t)n)
        return fail(err, errlen, "%s: tensor '%s': cannot read its data: %s", label,
                    shown(e->name, nb, sizeof nb),
                    r < 0 ? strerror(errno) : "the file ended early (it shrank after opening)");
    return 0;
}

/* ---- writing ---------------------------------------------------------- */

typedef struct {
    char *b;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *s, const char *p, size_t n)
{
    if (s->oom)
        return;
    if (s->n + n + 1 > s->cap) {
        size_t c = s->cap ? s->cap : 256;
        while (c < s->n + n + 1)
            c *= 2;
        char *nb = realloc(s->b, c);
        if (!nb) {
            s->oom = 1;
            return;
        }
        s->b = nb;
        s->cap = c;
    }
    memcpy(s->b + s->n, p, n);
    s->n += n;
}

static void sb_str(sbuf *s, const char *p)
{
    sb_add(s, p, strlen(p));
}

static void sb_fmt(sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_fmt(sbuf *s, const char *fmt, ...)
{
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    sb_add(s, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string literal; s is valid UTF-8 without NUL. */
static void sb_json(sbuf *s, const char *p)
{
    sb_add(s, "\"", 1);
    for (; *p; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_add(s, e, 2);
        } else if (c < 0x20) {
            sb_fmt(s, "\\u%04x", c);
        } else {
            sb_add(s, p, 1);
        }
    }
    sb_add(s, "\"", 1);
}

static int cmp_write_order(const void *a, const void *b)
{
    const ml_st_tensor *x = *(const ml_st_tensor *const *)a, *y = *(const ml_st_tensor *const *)b;
    size_t sx = ml_dtype_size(x->dtype), sy = ml_dtype_size(y->dtype);
    if (sx != sy)
        return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int write_full(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : n;
        ssize_t w = write(fd, c, chunk);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int fsync_dir(const char *path)
{
    size_t n = strlen(path);
    char *dir = malloc(n + 2);
    if (!dir)
        return -1;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    if (!slash)
        strcpy(dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    if (fd < 0)
        return -1;
    int r = fsync(fd);
    int saved = errno;
    close(fd);
    errno = saved;
    return r;
}

/* Refuse what the reader would refuse (and, when need_data, a tensor
 * without data); fills each tensor's byte size. */
static int check_inputs(const char *path, const ml_st_tensor *ts, size_t n,
                        const char *const *meta_kv, size_t nmeta, int need_data, uint64_t *nbytes,
                        char *err, size_t errlen)
{
    char nb[NAME_SHOWN + 8];
    int oom;
    for (size_t i = 0; i < n; i++) {
        const ml_st_tensor *t = &ts[i];
        if (!t->name)
            return fail(err, errlen, "%s: tensor #%zu has no name", path, i + 1);
        const char *nm = shown(t->name, nb, sizeof nb);
        if (!valid_utf8(t->name))
            return fail(err, errlen, "%s: tensor name '%s' is not valid UTF-8", path, nm);
        if (strcmp(t->name, "__metadata__") == 0)
            return fail(err, errlen, "%s: '__metadata__' cannot name a tensor", path);
        if ((unsigned)t->dtype >= ML_NDTYPES)
            return fail(err, errlen, "%s: tensor '%s': bad dtype %d", path, nm, (int)t->dtype);
        if (t->ndim < 0 || t->ndim > ML_MAXDIM)
            return fail(err, errlen, "%s: tensor '%s': %d dims (at most %d)", path, nm, t->ndim,
                        ML_MAXDIM);
        int64_t numel = ml_shape_numel(t->ndim, t->shape);
        if (numel < 0 || (uint64_t)numel > (uint64_t)INT64_MAX / ml_dtype_size(t->dtype))
            return fail(err, errlen, "%s: tensor '%s': bad shape", path, nm);
        nbytes[i] = (uint64_t)numel * ml_dtype_size(t->dtype);
        if (need_data && nbytes[i] && !t->data)
            return fail(err, errlen, "%s: tensor '%s': no data", path, nm);
    }
    for (size_t i = 0; i < 2 * nmeta; i++) {
        if (!meta_kv[i] || !valid_utf8(meta_kv[i]))
            return fail(err, errlen, "%s: metadata %s #%zu is %s", path, i % 2 ? "value" : "key",
                        i / 2 + 1, meta_kv[i] ? "not valid UTF-8" : "missing");
    }
    const char *dup = first_duplicate(ts, n, sizeof *ts, &oom);
    if (!oom && !dup)
        dup = first_duplicate(meta_kv, nmeta, 2 * sizeof *meta_kv, &oom);
    if (oom)
        return fail(err, errlen, "%s: out of memory", path);
    if (dup)
        return fail(err, errlen, "%s: duplicate name '%s'", path, shown(dup, nb, sizeof nb));
    return 0;
}

/* The header JSON, padded with spaces so the data starts 8-aligned. */
static int build_header(sbuf *h, const ml_st_tensor *const *order, size_t n,
                        const uint64_t *nbytes_sorted, const char *const *meta_kv, size_t nmeta)
{
    const char *format = "pt";
    for (size_t i = 0; i < nmeta; i++)
        if (strcmp(meta_kv[2 * i], "format") == 0)
            format = meta_kv[2 * i + 1];
    sb_str(h, "{\"__metadata__\":{\"format\":");
    sb_json(h, format);
    for (size_t i = 0; i < nmeta; i++) {
        if (strcmp(meta_kv[2 * i], "format") == 0)
            continue;
        sb_str(h, ",");
        sb_json(h, meta_kv[2 * i]);
        sb_str(h, ":");
        sb_json(h, meta_kv[2 * i + 1]);
    }
    sb_str(h, "}");
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const ml_st_tensor *t = order[i];
        sb_str(h, ",");
        sb_json(h, t->name);
        sb_str(h, ":{\"dtype\":");
        sb_json(h, ml_st_dtype_names[t->dtype]);
        sb_str(h, ",\"shape\":[");
        for (int d = 0; d < t->ndim; d++)
            sb_fmt(h, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        sb_fmt(h, "],\"data_offsets\":[%llu,", (unsigned long long)at);
        at += nbytes_sorted[i];
        sb_fmt(h, "%llu]}", (unsigned long long)at);
    }
    sb_str(h, "}");
    while (h->n % 8)
        sb_str(h, " ");
    return h->oom ? -1 : 0;
}

/* A tensor's bytes to fd: directly from host memory, or from a device
 * through the stage, one stage at a time. */
static int write_data(int fd, const ml_st_tensor *t, size_t nbytes, void *stage, size_t stage_len)
{
    if (!t->mem)
        return write_full(fd, t->data, nbytes);
    for (size_t at = 0; at < nbytes; at += stage_len) {
        size_t len = nbytes - at < stage_len ? nbytes - at : stage_len;
        if (t->mem->memcpy(stage, (const char *)t->data + at, len, ML_COPY_D2H, NULL) != ML_OK) {
            errno = EIO;   /* the device's own error text is in ml_cuda_last_error */
            return -1;
        }
        if (write_full(fd, stage, len))
            return -1;
    }
    return 0;
}

static void put_le64(uint8_t *b, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}

/* A file before its data: the tensors in file order, their byte sizes in
 * that order, and the header JSON (padded). */
typedef struct {
    const ml_st_tensor **order;
    uint64_t *nbytes;
    sbuf json;
} draft;

static void draft_free(draft *d)
{
    free(d->order);
    free(d->nbytes);
    free(d->json.b);
}

/* Check the tensors and metadata and draft their file; *d is always left
 * for draft_free. */
static int draft_file(draft *d, const char *path, const ml_st_tensor *ts, size_t n,
                      const char *const *meta_kv, size_t nmeta, int need_data, char *err,
                      size_t errlen)
{
    uint64_t *nbytes = calloc(n ? n : 1, sizeof *nbytes);
    int rc = -1;
    memset(d, 0, sizeof *d);
    d->order = calloc(n ? n : 1, sizeof *d->order);
    d->nbytes = calloc(n ? n : 1, sizeof *d->nbytes);
    if (!nbytes || !d->order || !d->nbytes) {
        fail(err, errlen, "%s: out of memory", path);
        goto done;
    }
    if (check_inputs(path, ts, n, meta_kv, nmeta, need_data, nbytes, err, errlen))
        goto done;
    for (size_t i = 0; i < n; i++)
        d->order[i] = &ts[i];
    qsort(d->order, n, sizeof *d->order, cmp_write_order);
    for (size_t i = 0; i < n; i++)
        d->nbytes[i] = nbytes[d->order[i] - ts];
    if (build_header(&d->json, d->order, n, d->nbytes, meta_kv, nmeta)) {
        fail(err, errlen, "%s: out of memory building the header", path);
        goto done;
    }
    if (d->json.n > ML_ST_MAX_HEADER) {
        fail(err, errlen, "%s: the header would be %zu bytes, over the limit of %u", path,
             d->json.n, ML_ST_MAX_HEADER);
        goto done;
    }
    rc = 0;
done:
    free(nbytes);
    return rc;
}

int ml_st_write(const char *path, const ml_st_tensor *ts, size_t n,
                const char *const *meta_kv, size_t nmeta, char *err, size_t errlen)
{
    return ml_st_write_staged(path, ts, n, meta_kv, nmeta, NULL, 0, err, errlen);
}

int ml_st_write_staged(const char *path, const ml_st_tensor *ts, size_t n,
                       const char *const *meta_kv, size_t nmeta, void *stage, size_t stage_len,
                       char *err, size_t errlen)
{
    draft d;
    char *tmp = NULL;
    int fd = -1, rc = -1;

    if (draft_file(&d, path, ts, n, meta_kv, nmeta, 1, err, errlen))
        goto done;
    for (size_t i = 0; i < n; i++) {
        if (ts[i].mem && (!stage || !stage_len)) {
            fail(err, errlen, "%s: tensor '%s' is on a device but no host stage was given", path,
                 ts[i].name);
            goto done;
        }
    }
    if (!(tmp = malloc(strlen(path) + 5))) {
        fail(err, errlen, "%s: out of memory", path);
        goto done;
    }
    strcpy(tmp, path);
    strcat(tmp, ".tmp");
    if ((fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        fail(err, errlen, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        goto done;
    }
    uint8_t lenbuf[8];
    put_le64(lenbuf, d.json.n);
    if (write_full(fd, lenbuf, 8) || write_full(fd, d.json.b, d.json.n))
        goto io_error;
    for (size_t i = 0; i < n; i++)
        if (d.nbytes[i] && write_data(fd, d.order[i], (size_t)d.nbytes[i], stage, stage_len))
            goto io_error;
    if (fsync(fd))
        goto io_error;
    int c = close(fd);
    fd = -1;
    if (c)
        goto io_error;
    if (rename(tmp, path)) {
        fail(err, errlen, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
        unlink(tmp);
        goto done;
    }
    if (fsync_dir(path)) {
        fail(err, errlen, "%s: written, but syncing its directory failed: %s", path,
             strerror(errno));
        goto done;
    }
    rc = 0;
    goto done;
io_error:
    fail(err, errlen, "%s: writing %s failed: %s", path, tmp, strerror(errno));
    if (fd >= 0)
        close(fd);
    fd = -1;
    unlink(tmp);
done:
    draft_free(&d);
    free(tmp);
    return rc;
}

/* ---- writing by ranges ------------------------------------------------- */

int ml_st_layout(ml_st_file *f, uint8_t **header, const char *label, const ml_st_tensor *ts,
                 size_t n, const char *const *meta_kv, size_t nmeta, char *err, size_t errlen)
{
    draft d;
    uint64_t data_size = 0;
    ml_st_init(f);
    *header = NULL;
    if (draft_file(&d, label, ts, n, meta_kv, nmeta, 0, err, errlen) ||
        set_label(f, label, err, errlen))
        goto bad;
    for (size_t i = 0; i < n; i++) {
        if (d.nbytes[i] > UINT64_MAX - data_size) {
            fail(err, errlen, "%s: the tensors hold more than 2^64 bytes", label);
            goto bad;
        }
        data_size += d.nbytes[i];
    }
    if (!(*header = malloc(8 + d.json.n))) {
        fail(err, errlen, "%s: out of memory building the header", label);
        goto bad;
    }
    put_le64(*header, d.json.n);
    memcpy(*header + 8, d.json.b, d.json.n);
    f->data_start = 8 + d.json.n;
    f->data_size = data_size;
    /* The entries come from the reader's own parser: what a reader will see. */
    if (parse_header(f, label, *header + 8, d.json.n, data_size, err, errlen))
        goto bad;
    draft_free(&d);
    return 0;
bad:
    draft_free(&d);
    free(*header);
    *header = NULL;
    ml_st_close(f);
    return -1;
}

int ml_st_create(ml_st_file *f, const char *path, const ml_st_tensor *ts, size_t n,
                 const char *const *meta_kv, size_t nmeta, char *err, size_t errlen)
{
    uint8_t *header;
    if (ml_st_layout(f, &header, path, ts, n, meta_kv, nmeta, err, errlen))
        return -1;
    if ((f->fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        fail(err, errlen, "%s: cannot create: %s", path, strerror(errno));
        goto bad;
    }
    /* The final length at once, so that every writer can pwrite anywhere;
     * the data is a hole until written, and reads as zeros. fallocate is
     * not needed for correctness: it would only move a full disk's error
     * from a range's write to here. */
    if (write_full(f->fd, header, (size_t)f->data_start) ||
        ftruncate(f->fd, (off_t)(f->data_start + f->data_size))) {
        fail(err, errlen, "%s: writing the header failed: %s", path, strerror(errno));
        goto bad;
    }
    f->writable = 1;
    free(header);
    return 0;
bad:
    free(header);
    ml_st_close(f);
    return -1;
}

/* pwrite all n bytes at off; -1 with errno. */
static int pwrite_full(int fd, const void *src, size_t n, uint64_t off)
{
    size_t put = 0;
    while (put < n) {
        size_t chunk = n - put > (1u << 30) ? (1u << 30) : n - put;
        ssize_t w = pwrite(fd, (const char *)src + put, chunk, (off_t)(off + put));
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (w == 0)
                errno = EIO;   /* no progress: never loop forever */
            return -1;
        }
        put += (size_t)w;
    }
    return 0;
}

int ml_st_write_range(const ml_st_file *f, size_t i, uint64_t off, uint64_t n, const void *src,
                      char *err, size_t errlen)
{
    char nb[NAME_SHOWN + 8];
    const ml_st_entry *e = open_entry(f, i, err, errlen);
    if (!e)
        return -1;
    if (!f->writable)
        return fail(err, errlen, "%s: not open for writing", label_of(f));
    uint64_t es = ml_dtype_size(e->dtype), numel = (e->end - e->begin) / es;
    if (off > numel || n > numel - off)
        return fail(err, errlen, "%s: tensor '%s': elements [%llu, %llu) are outside its %llu",
                    label_of(f), shown(e->name, nb, sizeof nb), (unsigned long long)off,
                    (unsigned long long)(off + n), (unsigned long long)numel);
    if (n && pwrite_full(f->fd, src, (size_t)(n * es), f->data_start + e->begin + off * es))
        return fail(err, errlen, "%s: tensor '%s': writing elements [%llu, %llu) failed: %s",
                    label_of(f), shown(e->name, nb, sizeof nb), (unsigned long long)off,
                    (unsigned long long)(off + n), strerror(errno));
    return 0;
}

int ml_st_sync(const ml_st_file *f, char *err, size_t errlen)
{
    if (f->fd < 0)
        return fail(err, errlen, "%s: not an open file", label_of(f));
    if (fsync(f->fd))
        return fail(err, errlen, "%s: fsync failed: %s", label_of(f), strerror(errno));
    return 0;
}
