/*
 * host/bindings/libs.c - the table of preloaded C libraries. A new binding file adds
 * its luaopen here and its declaration in libs.h.
 */
#include "libs.h"

const luaL_Reg ml_libs[] = {
    {"moelua.tensor", luaopen_moelua_tensor},
    {"moelua.mem", luaopen_moelua_mem},
    {"moelua.pool", luaopen_moelua_pool},
    {"moelua.io", luaopen_moelua_io},
    {"moelua.fs", luaopen_moelua_fs},
    {"moelua.bench", luaopen_moelua_bench},
    {"moelua.router", luaopen_moelua_router},
    {"moelua.experts", luaopen_moelua_experts},
    {"moelua.ops", luaopen_moelua_ops},
    {"moelua.optim_c", luaopen_moelua_optim_c},
    {"moelua.attach", luaopen_moelua_attach},
    {"moelua.host", luaopen_moelua_host},
    {"moelua.unit", luaopen_moelua_unit},
    {"moelua.dist", luaopen_moelua_dist},
    {"moelua.store", luaopen_moelua_store},
    {NULL, NULL}
};
