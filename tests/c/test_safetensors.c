/*
 * tests/c/test_safetensors.c - the safetensors reader and writer
 * (host/runtime/safetensors.c) on byte buffers and files, printing TAP.
 *
 * Covers: valid headers (scalar, zero-size, escapes, metadata), each class
 * of malformed header with the message it must produce, a write/open/read
 * round trip with alignment, and a mutation sweep (every truncation, random
 * byte flips) that must end in an error or a self-consistent result, never a
 * crash (run under `make sanitize` for out-of-bounds reads). Files written
 * by ranges: the layout's header is ml_st_write's, ranges written in
 * shuffled order by several writers give ml_st_write's file byte for byte,
 * ranges read back through the ops (ml_op_read_range, ml_op_write_range)
 * equal their slices, with bf16 conversion in both directions, across more
 * than one host stage, refusals, and nothing done inside a plan. Not here:
 * the Lua binding (tests/spec/safetensors_spec.lua).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "ops_io.h"
#include "safetensors.h"
#include "tap.h"


/* A file: 8-byte length of json, json, then ndata bytes 0, 1, 2, ... */
static unsigned char *mkfile(const char *json, size_t ndata, size_t *len)
{
    size_t h = strlen(json);
    unsigned char *b = malloc(8 + h + ndata + 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, json, h);
    for (size_t i = 0; i < ndata; i++)
        b[8 + h + i] = (unsigned char)i;
    *len = 8 + h + ndata;
    return b;
}

/* Parse json + ndata bytes; expect success (want == NULL) or an error containing want. */
static void expect(const char *desc, const char *json, size_t ndata, const char *want)
{
    size_t len;
    unsigned char *b = mkfile(json, ndata, &len);
    ml_st_file f;
    char err[1024] = "";
    int r = ml_st_parse(&f, "t.safetensors", b, len, err, sizeof err);
    if (!want)
        ok(r == 0, "%s (%s)", desc, r ? err : "parsed");
    else
        ok(r != 0 && strstr(err, want) != NULL, "%s: '%s' in '%s'", desc, want, err);
    if (r != 0)
        ok(f.entries == NULL && f.arena == NULL && f.label == NULL && f.fd == -1,
           "%s: a failed parse leaves nothing allocated", desc);
    ml_st_close(&f);
    free(b);
}

static const ml_st_entry *find(const ml_st_file *f, const char *name)
{
    for (size_t i = 0; i < f->nentries; i++)
        if (strcmp(f->entries[i].name, name) == 0)
            return &f->entries[i];
    return NULL;
}

static void test_valid(void)
{
    size_t len;
    char err[512];
    ml_st_file f;
    unsigned char *b = mkfile(" {\"__metadata__\":{\"format\":\"pt\",\"k\\u00e9\":\"v\\n\"},"
                              "\"b\":{\"shape\":[],\"dtype\":\"I64\",\"data_offsets\":[24,32]},"
                              "\"a\\ud83d\\ude00\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                              "\"data_offsets\":[0,24]},"
                              "\"z\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[32,32]}}   ",
                              32, &len);
    int r = ml_st_parse(&f, "t", b, len, err, sizeof err);
    ok(r == 0, "valid file with metadata, scalar, zero-size and escaped names parses%s%s",
       r ? ": " : "", r ? err : "");
    if (r == 0) {
        const ml_st_entry *a = find(&f, "a\xf0\x9f\x98\x80"), *s = find(&f, "b"), *z = find(&f, "z");
        ok(f.nentries == 3 && a && s && z, "three entries, surrogate pair decoded to UTF-8");
        ok(a && a->dtype == ML_F32 && a->ndim == 2 && a->shape[0] == 2 && a->shape[1] == 3 &&
           a->begin == 0 && a->end == 24, "F32 [2,3] at [0,24]");
        ok(s && s->dtype == ML_I64 && s->ndim == 0 && s->begin == 24 && s->end == 32,
           "scalar I64 at [24,32]");
        ok(z && z->dtype == ML_BF16 && z->ndim == 2 && z->shape[0] == 0 && z->begin == 32,
           "zero-size BF16 [0,5]");
        ok(f.entries[0].begin == 0 && f.entries[2].begin == 32, "entries sorted by offset");
        ok(f.nmeta == 2 && strcmp(f.meta[1].key, "k\xc3\xa9") == 0 &&
           strcmp(f.meta[1].value, "v\n") == 0, "metadata escapes decoded");
        ok(f.data_start == 8 + len - 8 - 32 && f.data_size == 32, "data section located");
    }
    ml_st_close(&f);
    ml_st_close(&f);
    ok(f.entries == NULL && f.fd == -1, "close is idempotent");
    free(b);

    expect("empty header object, no data", "{}", 0, NULL);
    expect("only metadata", "{\"__metadata__\":{}}", 0, NULL);
    expect("JSON whitespace around tokens", "\t{ \"w\" :\r\n{ \"dtype\" : \"U8\" , \"shape\" : [ 1 ] , "
           "\"data_offsets\" : [ 0 , 1 ] } }\n", 1, NULL);
    expect("all seven dtypes", "{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
           "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[8,16]},"
           "\"c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[16,20]},"
           "\"d\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[20,24]},"
           "\"e\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[24,26]},"
           "\"f\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[26,28]},"
           "\"g\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[28,29]}}", 29, NULL);
    expect("several zero-size tensors at one offset",
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
           "\"c\":{\"dtype\":\"F32\",\"shape\":[3,0],\"data_offsets\":[4,4]}}", 4, NULL);
    expect("8 dims", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}",
           2, NULL);
}

static void test_prefix(void)
{
    char err[512];
    ml_st_file f;
    unsigned char b[16] = {0};
    int r = ml_st_parse(&f, "t", b, 5, err, sizeof err);
    ok(r && strstr(err, "t: file is 5 bytes, too short for the 8-byte header length"),
       "truncated length prefix: %s", err);
    b[0] = 0x01; b[1] = 0xe1; b[2] = 0xf5; b[3] = 0x05;   /* 100000001 */
    r = ml_st_parse(&f, "t", b, 16, err, sizeof err);
    ok(r && strstr(err, "header length 100000001 exceeds the limit of 100000000 bytes"),
       "header length over the limit: %s", err);
    memset(b, 0xff, 8);
    r = ml_st_parse(&f, "t", b, 16, err, sizeof err);
    ok(r && strstr(err, "exceeds the limit"), "header length 2^64-1: %s", err);
    memset(b, 0, 8);
    b[0] = 9;
    r = ml_st_parse(&f, "t", b, 16, err, sizeof err);
    ok(r && strstr(err, "header length 9 runs past the end of the file (16 bytes)"),
       "header length beyond the file: %s", err);
    b[0] = 0;
    r = ml_st_parse(&f, "t", b, 8, err, sizeof err);
    ok(r && strstr(err, "the header is empty"), "zero-length header: %s", err);
}

static void test_json(void)
{
    static const struct { const char *desc, *json, *want; } cases[] = {
        {"not an object", "[1]", "the header must be a JSON object, got an array"},
        {"garbage", "hello", "bad JSON in the header at byte 0: unexpected character 'h'"},
        {"unterminated object", "{\"a\":{\"dtype\":\"U8\"", "expected ',' or '}', got the end"},
        {"missing colon", "{\"a\" {}}", "expected ':', got '{'"},
        {"trailing comma", "{\"__metadata__\":{},}", "expected a string key"},
        {"unquoted key", "{a:1}", "expected a string key"},
        {"single quotes", "{'a':1}", "expected a string key"},
        {"trailing garbage", "{} x", "at byte 3: trailing characters after the header object"},
        {"two objects", "{}{}", "trailing characters after the header object"},
        {"NUL padding", "{}\0", "trailing characters"},
        {"unterminated string", "{\"abc", "unterminated string"},
        {"bad escape", "{\"a\\q\":1}", "invalid escape '\\q'"},
        {"short \\u", "{\"\\u12\"}", "bad hex digit in a \\u escape"},
        {"truncated \\u", "{\"\\u1", "truncated \\u escape"},
        {"lone high surrogate", "{\"\\ud800x\":1}", "unpaired high surrogate \\ud800"},
        {"lone low surrogate", "{\"\\udc00\":1}", "unpaired low surrogate \\udc00"},
        {"bad surrogate pair", "{\"\\ud800\\u0041\":1}", "high surrogate \\ud800 followed by \\u0041"},
        {"\\u0000", "{\"a\\u0000b\":1}", "\\u0000 in a string is not supported"},
        {"control character", "{\"a\tb\":1}", "control character 0x09 in a string"},
        {"invalid UTF-8", "{\"\xff\":1}", "invalid UTF-8 in a string"},
        {"overlong UTF-8", "{\"\xc0\xaf\":1}", "invalid UTF-8"},
        {"UTF-8 surrogate", "{\"\xed\xa0\x80\":1}", "invalid UTF-8"},
        {"truncated UTF-8", "{\"\xe2\x82", "invalid UTF-8"},
        {"leading zero", "{\"a\":{\"dtype\":\"U8\",\"shape\":[01],\"data_offsets\":[0,1]}}",
         "leading zero in a number"},
        {"negative dim", "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}",
         "tensor 'a': shape must be a non-negative integer, got a negative number"},
        {"fraction", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.0],\"data_offsets\":[0,1]}}",
         "tensor 'a': shape must be an integer, got a fraction or exponent"},
        {"exponent", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1e0]}}",
         "data_offsets must be an integer, got a fraction or exponent"},
        {"integer over 64 bits", "{\"a\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],"
         "\"data_offsets\":[0,1]}}", "tensor 'a': shape: integer too large"},
        {"string dim", "{\"a\":{\"dtype\":\"U8\",\"shape\":[\"1\"],\"data_offsets\":[0,1]}}",
         "tensor 'a': shape must be a non-negative integer, got a string"},
        {"nested array", "{\"a\":{\"dtype\":\"U8\",\"shape\":[[1]],\"data_offsets\":[0,1]}}",
         "got an array"},
        {"deep nesting", "{\"a\":{\"dtype\":{\"x\":{\"y\":{}}}}}",
         "tensor 'a': dtype must be a string, got an object"},
        {"deep nesting in metadata", "{\"__metadata__\":{\"k\":[[[[]]]]}}",
         "metadata 'k' must be a string, got an array"},
        {"entry not an object", "{\"a\":[1]}", "tensor 'a' must be an object, got an array"},
        {"true", "{\"a\":true}", "tensor 'a' must be an object, got a boolean"},
        {"bare word", "{\"a\":{\"dtype\":\"U8\",\"shape\":[x]}}", "unexpected character 'x'"},
        {"missing element", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,],\"data_offsets\":[0,1]}}",
         "unexpected character ']'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t len;
        /* "NUL padding" holds a NUL: use its literal length. */
        const char *j = cases[i].json;
        size_t h = strcmp(cases[i].desc, "NUL padding") == 0 ? 3 : strlen(j);
        unsigned char *b = malloc(8 + h);
        for (int k = 0; k < 8; k++)
            b[k] = (unsigned char)((uint64_t)h >> (8 * k));
        memcpy(b + 8, j, h);
        len = 8 + h;
        ml_st_file f;
        char err[1024] = "";
        int r = ml_st_parse(&f, "t.safetensors", b, len, err, sizeof err);
        ok(r != 0 && strstr(err, cases[i].want) && strncmp(err, "t.safetensors: ", 15) == 0,
           "JSON: %s: '%s' in '%s'", cases[i].desc, cases[i].want, err);
        ml_st_close(&f);
        free(b);
    }
}

static void test_schema(void)
{
    expect("BOOL refused by name", "{\"m\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
           "t.safetensors: tensor 'm': dtype BOOL is not supported (F32, F64, BF16, F16, I32, I64, U8)");
    expect("F8_E4M3 refused", "{\"m\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
           "dtype F8_E4M3 is not supported");
    expect("lowercase dtype refused", "{\"m\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
           4, "dtype f32 is not supported");
    expect("missing dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           "tensor 'w': missing 'dtype'");
    expect("missing shape", "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4,
           "tensor 'w': missing 'shape'");
    expect("missing offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4,
           "tensor 'w': missing 'data_offsets'");
    expect("unknown key", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4,
           "tensor 'w': unknown key 'x'");
    expect("duplicate key in an entry",
           "{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           "tensor 'w': duplicate key 'dtype'");
    expect("duplicate tensor names", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
           "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
           "t.safetensors: duplicate tensor name 'w'");
    expect("duplicate names via escapes", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
           "\"\\u0077\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
           "duplicate tensor name 'w'");
    expect("duplicate __metadata__", "{\"__metadata__\":{},\"__metadata__\":{}}", 0,
           "duplicate key '__metadata__'");
    expect("duplicate metadata key", "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", 0,
           "duplicate metadata key 'a'");
    expect("metadata not an object", "{\"__metadata__\":\"pt\"}", 0,
           "'__metadata__' must be an object of strings, got a string");
    expect("metadata number value", "{\"__metadata__\":{\"format\":\"pt\",\"step\":3}}", 0,
           "metadata 'step' must be a string, got a number");
    expect("metadata null value", "{\"__metadata__\":{\"x\":null}}", 0,
           "metadata 'x' must be a string, got null");
    expect("too many dims", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
           "\"data_offsets\":[0,1]}}", 1, "tensor 'a': shape has more than 8 dims");
    expect("three offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1,
           "tensor 'a': data_offsets must be [begin, end], got more than 2 integers");
    expect("one offset", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1,
           "data_offsets must be [begin, end], got 1 integers");
    expect("shape overflow [2^62,4]",
           "{\"a\":{\"dtype\":\"U8\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,0]}}", 0,
           "tensor 'a': shape [4611686018427387904,4] has too many elements");
    expect("bytes overflow [2^62] F32",
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
           "has too many elements");
    expect("dim over int64",
           "{\"a\":{\"dtype\":\"U8\",\"shape\":[0,9223372036854775808],\"data_offsets\":[0,0]}}", 0,
           "shape [0,9223372036854775808] has too many elements");
    expect("offsets that mismatch the shape",
           "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,10]}}", 10,
           "t.safetensors: tensor 'w': data_offsets [0,10] do not match shape [2,3] of F32 (24 bytes)");
    expect("reversed offsets", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[5,4]}}", 5,
           "tensor 'w': data_offsets [5,4] end before they begin");
    expect("offsets past the data", "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 3,
           "tensor 'w': data_offsets [0,4] run past the end of the data section (3 bytes)");
    expect("offsets near 2^64", "{\"w\":{\"dtype\":\"U8\",\"shape\":[2],"
           "\"data_offsets\":[18446744073709551615,1]}}", 2, "end before they begin");
    expect("huge offsets matching the shape", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],"
           "\"data_offsets\":[18446744073709551614,18446744073709551615]}}", 2,
           "run past the end of the data section");
    expect("gap at the start", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
           "tensor 'w': data_offsets [1,2] leave a gap of 1 bytes after the start of the data section");
    expect("gap between tensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
           "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}", 3,
           "tensor 'b': data_offsets [2,3] leave a gap of 1 bytes after tensor 'a'");
    expect("overlap", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
           "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3,
           "tensor 'b': data_offsets [1,3] overlap tensor 'a' [0,2]");
    expect("same range twice", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
           "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
           "tensor 'b': data_offsets [0,2] overlap tensor 'a' [0,2]");
    expect("zero-size tensor inside another", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],"
           "\"data_offsets\":[0,2]},\"b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[1,1]}}", 2,
           "tensor 'b': data_offsets [1,1] overlap tensor 'a' [0,2]");
    expect("trailing bytes after the data", "{\"w\":{\"dtype\":\"U8\",\"shape\":[2],"
           "\"data_offsets\":[0,2]}}", 5,
           "the tensors cover 2 bytes of the 5-byte data section (3 trailing bytes)");
    expect("data without tensors", "{}", 1, "the tensors cover 0 bytes of the 1-byte data section");
    expect("control characters in names are not echoed",
           "{\"a\\nb\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}", 0,
           "tensor 'a?b': dtype X");
}

/* Write, open, read back; offsets aligned; the temporary file is gone. */
static void test_roundtrip(void)
{
    char path[] = "/tmp/test_safetensors_XXXXXX", file[64], tmp[80], err[512];
    ok(mkdtemp(path) != NULL, "temporary directory");
    snprintf(file, sizeof file, "%s/m.safetensors", path);
    snprintf(tmp, sizeof tmp, "%s.tmp", file);

    uint8_t u8[3] = {1, 2, 3};
    double f64[2] = {1.5, -2.25};
    float f32[6] = {1, 2, 3, 4, 5, 6};
    uint16_t bf16[1] = {0x3f80};
    int64_t i64[1] = {-7};
    int64_t s3[1] = {3}, s2[1] = {2}, s23[2] = {2, 3}, s1[1] = {1}, s0[2] = {0, 4};
    ml_st_tensor ts[] = {
        {"u", ML_U8, 1, s3, u8, NULL},
        {"b", ML_BF16, 1, s1, bf16, NULL},
        {"f", ML_F32, 2, s23, f32, NULL},
        {"d", ML_F64, 1, s2, f64, NULL},
        {"scalar \"q\"\n", ML_I64, 0, NULL, i64, NULL},
        {"empty", ML_F16, 2, s0, NULL, NULL},
    };
    const char *meta[] = {"step", "12", "note", "caf\xc3\xa9"};
    int r = ml_st_write(file, ts, 6, meta, 2, err, sizeof err);
    ok(r == 0, "write six tensors%s%s", r ? ": " : "", r ? err : "");
    ok(access(tmp, F_OK) != 0, "no .tmp file is left behind");

    ml_st_file f;
    r = ml_st_open(&f, file, err, sizeof err);
    ok(r == 0, "open what was written%s%s", r ? ": " : "", r ? err : "");
    if (r == 0) {
        int aligned = 1, same = 1;
        ok(f.nentries == 6, "six entries");
        ok(f.data_start % 8 == 0, "header padded to a multiple of 8 (data at %llu)",
           (unsigned long long)f.data_start);
        for (size_t i = 0; i < f.nentries; i++) {
            const ml_st_entry *e = &f.entries[i];
            aligned &= (f.data_start + e->begin) % ml_dtype_size(e->dtype) == 0;
            const ml_st_tensor *t = NULL;
            for (size_t k = 0; k < 6; k++)
                if (strcmp(ts[k].name, e->name) == 0)
                    t = &ts[k];
            if (!t || t->dtype != e->dtype || t->ndim != e->ndim) {
                same = 0;
                continue;
            }
            char buf[64];
            if (ml_st_read(&f, i, buf, err, sizeof err))
                same = 0;
            else if (e->end > e->begin && memcmp(buf, t->data, (size_t)(e->end - e->begin)))
                same = 0;
            for (int d = 0; d < e->ndim; d++)
                same &= e->shape[d] == t->shape[d];
        }
        ok(aligned, "every tensor is aligned to its element size");
        ok(same, "names, dtypes, shapes and bytes round-trip");
        ok(strcmp(f.entries[0].name, "d") == 0 && strcmp(f.entries[1].name, "scalar \"q\"\n") == 0 &&
           strcmp(f.entries[2].name, "f") == 0, "8-byte types first, then 4-byte, by name");
        ok(f.nmeta == 3 && strcmp(f.meta[0].key, "format") == 0 &&
           strcmp(f.meta[0].value, "pt") == 0 && strcmp(f.meta[2].value, "caf\xc3\xa9") == 0,
           "metadata: format pt first, then the extra pairs");
        ok(ml_st_read(&f, 99, NULL, err, sizeof err) != 0 && strstr(err, "no tensor #99"),
           "reading a missing entry is an error");
        /* Truncate under the open file: the read must fail cleanly. */
        ok(truncate(file, (off_t)f.data_start + 4) == 0, "truncate the file while open");
        r = ml_st_read(&f, 0, (char[16]){0}, err, sizeof err);
        ok(r != 0 && strstr(err, "tensor 'd': cannot read its data: the file ended early"),
           "a file that shrank after opening: %s", err);
    }
    ml_st_close(&f);

    const char *fmt[] = {"format", "np"};
    r = ml_st_write(file, ts, 1, fmt, 1, err, sizeof err);
    ok(r == 0 && ml_st_open(&f, file, err, sizeof err) == 0 && f.nmeta == 1 &&
       strcmp(f.meta[0].value, "np") == 0, "a given format replaces pt");
    ml_st_close(&f);

    /* Through a stage: the tensors as if on a device (the CPU's memory
     * table copies), 5 bytes at a time: the same file, byte for byte. */
    FILE *fp = fopen(file, "rb");
    unsigned char direct[512], staged[512];
    size_t ndirect = fp ? fread(direct, 1, sizeof direct, fp) : 0;
    if (fp)
        fclose(fp);
    ml_st_tensor dev[6];
    memcpy(dev, ts, sizeof dev);
    for (int i = 0; i < 6; i++)
        dev[i].mem = ml_backend_cpu.mem;
    unsigned char stage[5];
    r = ml_st_write_staged(file, dev, 1, fmt, 1, stage, sizeof stage, err, sizeof err);
    fp = fopen(file, "rb");
    size_t nstaged = fp ? fread(staged, 1, sizeof staged, fp) : 0;
    if (fp)
        fclose(fp);
    ok(r == 0 && nstaged == ndirect && ndirect > 0 && memcmp(direct, staged, ndirect) == 0,
       "device tensors written through a 5-byte stage give the same file%s%s", r ? ": " : "",
       r ? err : "");
    ok(ml_st_write(file, dev, 1, NULL, 0, err, sizeof err) != 0 && strstr(err, "no host stage"),
       "device tensors without a stage are refused: %s", err);

    ml_st_tensor bad[] = {{"__metadata__", ML_U8, 1, s3, u8, NULL}};
    ok(ml_st_write(file, bad, 1, NULL, 0, err, sizeof err) != 0 && strstr(err, "'__metadata__'"),
       "writer refuses the name __metadata__");
    ml_st_tensor bad2[] = {{"\xff", ML_U8, 1, s3, u8, NULL}};
    ok(ml_st_write(file, bad2, 1, NULL, 0, err, sizeof err) != 0 && strstr(err, "not valid UTF-8"),
       "writer refuses invalid UTF-8 names");
    ml_st_tensor bad3[] = {{"x", ML_U8, 1, s3, u8, NULL}, {"x", ML_F32, 1, s1, f32, NULL}};
    ok(ml_st_write(file, bad3, 2, NULL, 0, err, sizeof err) != 0 && strstr(err, "duplicate name 'x'"),
       "writer refuses duplicate names");
    char missing[128];
    snprintf(missing, sizeof missing, "%s/no/such/dir/m.safetensors", path);
    ok(ml_st_write(missing, ts, 1, NULL, 0, err, sizeof err) != 0 && strstr(err, "cannot create"),
       "writing into a missing directory fails: %s", err);
    ok(ml_st_open(&f, missing, err, sizeof err) != 0 && strstr(err, "cannot open"),
       "opening a missing file fails: %s", err);
    ok(ml_st_open(&f, path, err, sizeof err) != 0 && strstr(err, "not a regular file"),
       "opening a directory fails: %s", err);
    unlink(file);
    rmdir(path);
}

/* Every truncation and many random mutations of a valid file: each parse
 * ends in an error or in entries that lie inside the buffer. */
static void test_mutations(void)
{
    size_t len;
    unsigned char *b = mkfile("{\"__metadata__\":{\"format\":\"pt\"},"
                              "\"a\":{\"dtype\":\"F32\",\"shape\":[2,1],\"data_offsets\":[0,8]},"
                              "\"b\\u00e9\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[8,9]}}",
                              9, &len);
    char err[512];
    ml_st_file f;
    int trunc_ok = 1, consistent = 1, nparsed = 0;
    for (size_t n = 0; n < len; n++) {
        unsigned char *c = malloc(n ? n : 1);
        memcpy(c, b, n);
        if (ml_st_parse(&f, "t", c, n, err, sizeof err) == 0)
            trunc_ok = 0;
        ml_st_close(&f);
        free(c);
    }
    ok(trunc_ok, "every truncation of a valid file is refused");

    uint64_t x = 0x9e3779b97f4a7c15u;
    for (int it = 0; it < 20000; it++) {
        unsigned char *c = malloc(len);
        memcpy(c, b, len);
        int flips = 1 + it % 3;
        for (int k = 0; k < flips; k++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            size_t pos = (size_t)(x % len);
            static const unsigned char pick[] = "{}[]\",:0123456789\\u -.eE\x00\xff";
            c[pos] = (x >> 32) & 1 ? (unsigned char)(x >> 40) : pick[(x >> 40) % (sizeof pick - 1)];
        }
        if (ml_st_parse(&f, "t", c, len, err, sizeof err) == 0) {
            nparsed++;
            for (size_t i = 0; i < f.nentries; i++)
                consistent &= f.entries[i].end <= f.data_size &&
                              f.data_start + f.data_size == len;
        } else {
            consistent &= strncmp(err, "t: ", 3) == 0;
        }
        ml_st_close(&f);
        free(c);
    }
    ok(consistent, "20000 mutated files: errors name the file, accepted ones stay in bounds "
       "(%d accepted)", nparsed);
    free(b);
}

/* The whole file at path (malloc'd), its length in *len; NULL if unreadable. */
static unsigned char *slurp(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    unsigned char *b = NULL;
    if (fp && fseek(fp, 0, SEEK_END) == 0) {
        long n = ftell(fp);
        rewind(fp);
        b = malloc(n > 0 ? (size_t)n : 1);
        *len = b ? fread(b, 1, (size_t)n, fp) : 0;
    }
    if (fp)
        fclose(fp);
    return b;
}

static int same_file(const char *a, const char *b)
{
    size_t na = 0, nb = 0;
    unsigned char *x = slurp(a, &na), *y = slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

/* One piece to write: elements [off, off + n) of entry. */
typedef struct {
    size_t entry;
    uint64_t off, n;
} piece;

static void test_ranges(void)
{
    char dir[] = "/tmp/test_st_ranges_XXXXXX", whole[64], ranged[64], err[512];
    ok(mkdtemp(dir) != NULL, "temporary directory");
    snprintf(whole, sizeof whole, "%s/whole.safetensors", dir);
    snprintf(ranged, sizeof ranged, "%s/ranged.safetensors", dir);

    uint8_t u8[7];
    double f64[5];
    float f32[24];
    uint16_t bf16[9];
    int64_t i64[1] = {-7};
    for (int i = 0; i < 24; i++) {
        f32[i] = (float)i * 0.5f - 3;
        if (i < 7) u8[i] = (uint8_t)(200 + i);
        if (i < 5) f64[i] = 1.0 / (i + 1);
        if (i < 9) bf16[i] = (uint16_t)(0x3f80 + i);
    }
    int64_t s7[1] = {7}, s5[1] = {5}, s46[2] = {4, 6}, s9[1] = {9}, s0[2] = {0, 4};
    ml_st_tensor ts[] = {
        {"u", ML_U8, 1, s7, u8, NULL},
        {"model.layers.0.w", ML_F32, 2, s46, f32, NULL},
        {"b", ML_BF16, 1, s9, bf16, NULL},
        {"d", ML_F64, 1, s5, f64, NULL},
        {"scalar", ML_I64, 0, NULL, i64, NULL},
        {"empty", ML_F16, 2, s0, NULL, NULL},
    };
    const size_t nts = sizeof ts / sizeof *ts;
    const char *meta[] = {"step", "12", "format", "pt"};
    int r = ml_st_write(whole, ts, nts, meta, 2, err, sizeof err);
    ok(r == 0, "the reference file%s%s", r ? ": " : "", r ? err : "");

    /* The layout: ml_st_write's header, and its entries as a reader sees them. */
    ml_st_file lay, ref;
    uint8_t *header = NULL;
    r = ml_st_layout(&lay, &header, "layout", ts, nts, meta, 2, err, sizeof err);
    ok(r == 0, "layout%s%s", r ? ": " : "", r ? err : "");
    size_t nwhole = 0;
    unsigned char *w = slurp(whole, &nwhole);
    ok(r == 0 && w && lay.data_start + lay.data_size == nwhole &&
       memcmp(header, w, (size_t)lay.data_start) == 0,
       "the layout's header is ml_st_write's, byte for byte, and its size the file's");
    free(w);
    r = ml_st_open(&ref, whole, err, sizeof err);
    int same = r == 0 && ref.nentries == lay.nentries && lay.fd == -1;
    for (size_t i = 0; same && i < lay.nentries; i++)
        same = strcmp(ref.entries[i].name, lay.entries[i].name) == 0 &&
               ref.entries[i].begin == lay.entries[i].begin &&
               ref.entries[i].end == lay.entries[i].end;
    ok(same, "the layout's entries are the reader's, in data order");
    free(header);
    ml_st_close(&ref);
    ml_st_close(&lay);
    ts[0].data = NULL;
    ok(ml_st_layout(&lay, &header, "layout", ts, 1, NULL, 0, err, sizeof err) == 0,
       "a layout needs no data");
    ml_st_close(&lay);
    free(header);
    ts[0].data = u8;

    /* Created, then written in pieces of 1..4 elements, shuffled, by three
     * writers with their own descriptors (the creator is one). */
    ml_st_file wr[3];
    r = ml_st_create(&wr[0], ranged, ts, nts, meta, 2, err, sizeof err);
    ok(r == 0, "create%s%s", r ? ": " : "", r ? err : "");
    for (int k = 1; k < 3; k++)
        ok(ml_st_open_rw(&wr[k], ranged, err, sizeof err) == 0, "writer %d opens the created file%s%s",
           k, err[0] ? ": " : "", err);
    piece pieces[64];
    size_t np = 0;
    for (size_t i = 0; i < wr[0].nentries; i++) {
        const ml_st_entry *en = &wr[0].entries[i];
        uint64_t numel = (en->end - en->begin) / ml_dtype_size(en->dtype);
        for (uint64_t at = 0, len = 1; at < numel; at += len, len = len % 4 + 1)
            pieces[np++] = (piece){i, at, numel - at < len ? numel - at : len};
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = np; i > 1; i--) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        size_t j = (size_t)(x % i);
        piece t = pieces[i - 1];
        pieces[i - 1] = pieces[j];
        pieces[j] = t;
    }
    int all = 1;
    for (size_t p = 0; p < np; p++) {
        const ml_st_entry *en = &wr[0].entries[pieces[p].entry];
        const ml_st_tensor *t = NULL;
        for (size_t k = 0; k < nts; k++)
            if (strcmp(ts[k].name, en->name) == 0)
                t = &ts[k];
        size_t es = ml_dtype_size(en->dtype);
        all &= ml_st_write_range(&wr[p % 3], pieces[p].entry, pieces[p].off, pieces[p].n,
                                 (const char *)t->data + pieces[p].off * es, err, sizeof err) == 0;
    }
    ok(all && np > 20, "%zu pieces written in shuffled order by three writers%s%s", np,
       all ? "" : ": ", all ? "" : err);
    ok(ml_st_sync(&wr[1], err, sizeof err) == 0, "sync");
    for (int k = 0; k < 3; k++)
        ml_st_close(&wr[k]);
    ok(same_file(whole, ranged), "the file written by ranges is ml_st_write's, byte for byte");

    /* Refusals. */
    r = ml_st_open_rw(&wr[0], ranged, err, sizeof err);
    size_t fi = 0;
    while (fi < wr[0].nentries && strcmp(wr[0].entries[fi].name, "model.layers.0.w") != 0)
        fi++;
    ok(ml_st_write_range(&wr[0], fi, 20, 5, f32, err, sizeof err) != 0 &&
       strstr(err, "tensor 'model.layers.0.w': elements [20, 25) are outside its 24"),
       "a range past the entry is refused: %s", err);
    ok(ml_st_write_range(&wr[0], fi, 25, 0, f32, err, sizeof err) != 0,
       "an empty range that starts past the entry is refused");
    ok(ml_st_write_range(&wr[0], 99, 0, 1, f32, err, sizeof err) != 0 && strstr(err, "no tensor #99"),
       "a missing entry is refused");
    ok(ml_st_write_range(&wr[0], fi, 24, 0, f32, err, sizeof err) == 0,
       "an empty range at the end is accepted");
    ml_st_close(&wr[0]);
    ok(ml_st_write_range(&wr[0], 0, 0, 1, f32, err, sizeof err) != 0 && strstr(err, "not an open file"),
       "a closed file is refused");
    r = ml_st_open(&ref, ranged, err, sizeof err);
    ok(r == 0 && ml_st_write_range(&ref, fi, 0, 1, f32, err, sizeof err) != 0 &&
       strstr(err, "not open for writing"), "a file opened for reading is refused: %s", err);
    ml_st_close(&ref);
    ok(same_file(whole, ranged), "refused writes changed nothing");
    char missing[96];
    snprintf(missing, sizeof missing, "%s/none.safetensors", dir);
    ok(ml_st_open_rw(&wr[0], missing, err, sizeof err) != 0 && strstr(err, "cannot open"),
       "open_rw of a missing file fails: %s", err);
    ok(ml_st_open_rw(&wr[0], dir, err, sizeof err) != 0 && strstr(err, "cannot open: Is a directory"),
       "open_rw of a directory fails: %s", err);
    FILE *fp = fopen(missing, "wb");
    if (fp) {
        fputs("not a safetensors file", fp);
        fclose(fp);
    }
    ok(ml_st_open_rw(&wr[0], missing, err, sizeof err) != 0 && strstr(err, "header length"),
       "open_rw of a corrupt file fails: %s", err);
    ml_st_tensor dup[] = {{"x", ML_U8, 1, s7, NULL, NULL}, {"x", ML_F32, 1, s5, NULL, NULL}};
    ok(ml_st_create(&wr[0], missing, dup, 2, NULL, 0, err, sizeof err) != 0 &&
       strstr(err, "duplicate name 'x'") && wr[0].fd == -1, "create refuses what ml_st_write refuses");
    unlink(missing);
    unlink(whole);
    unlink(ranged);
    rmdir(dir);
}

static ml_host host;

/* A new CPU tensor of dt and n elements. */
static ml_tensor cpu_tensor(ml_dtype dt, int64_t n)
{
    ml_tensor t = {0};
    ml_err e;
    if (ml_tensor_alloc(&host, &t, ML_CPU, dt, 1, &n, &e) != ML_OK) {
        fprintf(stderr, "test_safetensors: %s\n", e.msg);
        exit(1);
    }
    return t;
}

/* The ops: f32 tensors written to a bf16 entry (converted, in more than
 * one stage) and an f32 entry, read back by sub-ranges. */
static void test_range_ops(void)
{
    char dir[] = "/tmp/test_st_ops_XXXXXX", path[64], err[512];
    ok(mkdtemp(dir) != NULL, "temporary directory");
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    ml_host_init(&host);
    const int64_t big = (int64_t)(ML_IO_STAGE_BYTES / 4) * 2 + 5;   /* three f32 stages */
    int64_t sbig[1] = {big}, s10[1] = {10};
    ml_st_tensor ts[] = {{"h", ML_BF16, 1, sbig, NULL, NULL}, {"f", ML_F32, 1, s10, NULL, NULL}};
    ml_st_file f;
    int r = ml_st_create(&f, path, ts, 2, NULL, 0, err, sizeof err);
    ok(r == 0, "create%s%s", r ? ": " : "", r ? err : "");
    size_t ih = strcmp(f.entries[0].name, "h") == 0 ? 0 : 1, iff = 1 - ih;

    /* bf16 values as f32, written in two ranges, the first across stages. */
    ml_tensor src = cpu_tensor(ML_F32, big);
    float *sv = ml_data(&src);
    for (int64_t i = 0; i < big; i++)
        sv[i] = (float)((i % 512) - 256) * 0.25f;   /* exact in bf16 */
    sv[3] = 1.0f + 1.0f / 512;                      /* rounds to 1 in bf16 */
    ml_err e;
    const int64_t cut = big - 7;
    ml_tensor head = src, tail = src;
    head.shape[0] = cut;
    tail.shape[0] = big - cut;
    tail.offset = src.offset + cut;
    size_t before = host.books[ML_CPU].total;
    ok(ml_op_write_range(&host, &f, ih, 0, &head, &e) == ML_OK &&
       ml_op_write_range(&host, &f, ih, cut, &tail, &e) == ML_OK,
       "f32 written to a bf16 entry in two ranges, the first over three stages");
    ok(host.books[ML_CPU].total == before, "the stages are released");

    /* Read back: a sub-range in f32 (converted) and in bf16 (in place). */
    ml_tensor back = cpu_tensor(ML_F32, big - 2), raw = cpu_tensor(ML_BF16, 4);
    ok(ml_op_read_range(&host, &back, &f, ih, 2, &e) == ML_OK, "a bf16 range read into f32");
    const float *bv = ml_data(&back);
    int exact = bv[1] == 1.0f;
    for (int64_t i = 2; i < big - 2; i++)
        exact &= bv[i] == sv[i + 2];
    ok(exact, "the range read back equals its slice, 1 + 2^-9 rounded to 1");
    uint32_t bits;
    memcpy(&bits, &sv[4], 4);   /* exact in bf16: its upper half */
    ok(ml_op_read_range(&host, &raw, &f, ih, 4, &e) == ML_OK &&
       ((uint16_t *)ml_data(&raw))[0] == (uint16_t)(bits >> 16),
       "a bf16 range read as bf16: the file's bytes");

    /* The f32 entry, element by element, then every sub-range. */
    ml_tensor ten = cpu_tensor(ML_F32, 10);
    for (int i = 0; i < 10; i++)
        ((float *)ml_data(&ten))[i] = (float)i + 0.5f;
    int all = 1;
    for (int64_t i = 9; i >= 0; i--) {
        ml_tensor one = ten;
        one.shape[0] = 1;
        one.offset = ten.offset + i;
        all &= ml_op_write_range(&host, &f, iff, i, &one, &e) == ML_OK;
    }
    ok(all, "an f32 entry written one element at a time, backwards");
    int slices = 1;
    for (int64_t a = 0; a <= 10; a++) {
        for (int64_t b = a; b <= 10; b++) {
            ml_tensor d = cpu_tensor(ML_F32, b - a);
            slices &= ml_op_read_range(&host, &d, &f, iff, a, &e) == ML_OK &&
                      (b == a || memcmp(ml_data(&d), (float *)ml_data(&ten) + a,
                                        (size_t)(b - a) * 4) == 0);
            ml_tensor_drop(&d);
        }
    }
    ok(slices, "every sub-range [a, b) read back equals its slice");

    /* Refusals, and nothing done inside a plan. */
    ok(ml_op_write_range(&host, &f, iff, 8, &ten, &e) == ML_EINVAL &&
       strstr(e.msg, "'f': 10 elements at element offset 8 do not fit in its 10"),
       "a write past the entry: %s", e.msg);
    ok(ml_op_read_range(&host, &ten, &f, iff, -1, &e) == ML_EINVAL &&
       strstr(e.msg, "at element offset -1"), "a negative offset: %s", e.msg);
    ml_tensor ints = cpu_tensor(ML_I32, 2);
    ok(ml_op_write_range(&host, &f, iff, 0, &ints, &e) == ML_EINVAL &&
       strstr(e.msg, "'f' is f32 in the file and cannot be converted from i32"), "%s", e.msg);
    ml_tensor strided = ten;
    strided.shape[0] = 5;
    strided.stride[0] = 2;
    ok(ml_op_write_range(&host, &f, iff, 0, &strided, &e) == ML_EINVAL &&
       strstr(e.msg, "the source must be contiguous"), "%s", e.msg);
    ok(ml_op_write_range(&host, &f, 7, 0, &ten, &e) == ML_EINVAL && strstr(e.msg, "no entry #7"),
       "%s", e.msg);
    ml_tensor zero = cpu_tensor(ML_F32, 10);
    memset(ml_data(&zero), 0, 40);
    host.planning = 1;
    ok(ml_op_write_range(&host, &f, iff, 0, &zero, &e) == ML_OK &&
       ml_op_write_range(&host, &f, iff, 1, &zero, &e) == ML_EINVAL,
       "inside a plan a write is checked: %s", e.msg);
    ok(ml_op_read_range(&host, &zero, &f, iff, 0, &e) == ML_OK &&
       ((float *)ml_data(&zero))[9] == 0, "inside a plan a read reads nothing");
    host.planning = 0;
    ok(ml_op_read_range(&host, &zero, &f, iff, 0, &e) == ML_OK &&
       memcmp(ml_data(&zero), ml_data(&ten), 40) == 0, "and the plan's write wrote nothing");
    ml_st_close(&f);
    ok(ml_op_write_range(&host, &f, 0, 0, &ten, &e) == ML_EINVAL, "a closed file has no entries");

    ml_tensor *all_t[] = {&src, &back, &raw, &ten, &ints, &zero};
    for (size_t i = 0; i < sizeof all_t / sizeof *all_t; i++)
        ml_tensor_drop(all_t[i]);
    ok(host.books[ML_CPU].total == 0, "the ledger is back to zero");
    ml_host_free(&host);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    test_valid();
    test_prefix();
    test_json();
    test_schema();
    test_roundtrip();
    test_mutations();
    test_ranges();
    test_range_ops();
    return tap_done();
}
