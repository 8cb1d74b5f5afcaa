#!/usr/bin/env python3
"""Rewrite CUDA launches `k<T><<<g, b, s, st>>>(args);` in a .cu file into
`emu_launch([=] { k<T>(args); }, g, b, s, st);`, each dynamic shared
array into a pointer to the emulator's (see emu.h), and drops nvcc's
`#pragma unroll` hints (g++ warns on them; they change no result). Usage:
launch.py in.cu out.cpp. Everything else passes through; #line keeps the
compiler's and the emulator's line numbers those of the .cu file."""
import re
import sys

# `extern __shared__ [__align__(n)] T name[];` -> `T *name = (T *)emu_dyn_shared;`
DYN_SHARED = re.compile(r'extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\[\];')

# `#pragma unroll [n]` -> an empty line (the line numbers stay the .cu's)
UNROLL = re.compile(r'^[ \t]*#[ \t]*pragma[ \t]+unroll\b.*$', re.M)


def callee_start(s, i):
    """start of the kernel expression that ends just before s[i]"""
    j = i
    while j > 0 and s[j - 1] == '>':      # template arguments: balanced <...>
        depth, j = 0, j - 1
        while True:
            depth += {'>': 1, '<': -1}.get(s[j], 0)
            if depth == 0:
                break
            j -= 1
    while j > 0 and (s[j - 1].isalnum() or s[j - 1] in '_:'):
        j -= 1
    return j


def balanced(s, i, open_, close):
    """index just past the bracket that closes s[i] == open_"""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == open_) - (s[j] == close)
        if depth == 0:
            return j + 1
    raise SystemExit("unbalanced %s at %d" % (open_, i))


def rewrite(s):
    out, pos, n = [], 0, 0
    while True:
        i = s.find('<<<', pos)
        if i < 0:
            return ''.join(out) + s[pos:], n
        k = callee_start(s, i)
        e = s.find('>>>', i)
        cfg = s[i + 3:e]
        a = e + 3
        while s[a].isspace():
            a += 1
        b = balanced(s, a, '(', ')')
        out.append(s[pos:k])
        out.append('emu_launch([=] { %s%s; }, %s)' % (s[k:i], s[a:b], cfg))
        pos, n = b, n + 1


src, dst = sys.argv[1], sys.argv[2]
text = UNROLL.sub('', DYN_SHARED.sub(r'\1 *\2 = (\1 *)emu_dyn_shared;', open(src).read()))
text, n = rewrite(text)
with open(dst, 'w') as f:
    f.write('#line 1 "%s"\n' % src + text)
