/*
 * host/bindings/libs.h - the C libraries the host preloads (require "moelua.<lib>").
 * One binding file per library: host/l_<lib>.c.
 */
#ifndef ML_LIBS_H
#define ML_LIBS_H

#include <lauxlib.h>
#include <lua.h>

int luaopen_moelua_tensor(lua_State *L);
int luaopen_moelua_mem(lua_State *L);
int luaopen_moelua_pool(lua_State *L);
int luaopen_moelua_io(lua_State *L);
int luaopen_moelua_fs(lua_State *L);
int luaopen_moelua_bench(lua_State *L);
int luaopen_moelua_router(lua_State *L);
int luaopen_moelua_experts(lua_State *L);
int luaopen_moelua_ops(lua_State *L);
int luaopen_moelua_optim_c(lua_State *L);
int luaopen_moelua_attach(lua_State *L);
int luaopen_moelua_host(lua_State *L);
int luaopen_moelua_unit(lua_State *L);
int luaopen_moelua_dist(lua_State *L);
int luaopen_moelua_store(lua_State *L);

/* {name, luaopen} pairs, NULL-terminated; defined in host/bindings/libs.c. */
extern const luaL_Reg ml_libs[];

#endif
