/*
 * host/bindings/attach.h - the server of `moelua attach` (host/bindings/attach.c): a thread
 * that owns a Unix stream socket, answers query lines at once from the last
 * published snapshot in its own small Lua state, and queues the lines that
 * call a control for the training thread, which takes them at its safe
 * points and hands back their replies. Every function here is called by
 * the training thread (the one owning the job's Lua state); none raises:
 * each returns a status.
 *
 * Not here: the Lua binding `moelua.attach` (host/bindings/l_attach.c), what a line
 * sees and how its reply reads (lua/moelua/attach_env.lua), running the
 * controls (lua/moelua/remote.lua), the client (host/bindings/repl.c).
 */
#ifndef ML_ATTACH_H
#define ML_ATTACH_H

#include <stddef.h>
#include <sys/un.h>

/* A socket path's bytes at most, its NUL included (sun_path). */
#define ML_ATTACH_PATH_MAX sizeof(((struct sockaddr_un *)0)->sun_path)

typedef struct ml_attach ml_attach;

/* A server in a safe empty state (nothing open, no thread), or NULL. */
ml_attach *ml_attach_new(void);

/* Serve sock_path (shorter than ML_ATTACH_PATH_MAX): its directory made
 * (mode 0700, this user's), a socket left there by a dead job replaced
 * (one that a job serves, found by connecting to it: "another job serves
 * PATH"), the socket bound (0600), the server thread's Lua state set up from
 * dkjson.lua at json_path, moelua/attach_env.lua at env_path and
 * moelua/pretty.lua (the reply printer) at pretty_path, each
 * request line limited to `limit` instructions, and the thread started.
 * 0, or -1 with the reason in err (errlen bytes); then ml_attach_free. */
int ml_attach_listen(ml_attach *a, const char *sock_path, long long limit, const char *json_path,
                     const char *env_path, const char *pretty_path, char *err, size_t errlen);

/* Stop and join the thread, close every socket, remove the socket file
 * while it is the one bound (the same st_dev and st_ino; not one another
 * job bound there since), free everything. a may be in any state ml_attach_listen left it in. */
void ml_attach_free(ml_attach *a);

/* The snapshot the server thread answers from: a JSON object with any of
 * stats, ledger, progress, overrides, staged (a copy; replaces the last).
 * 0, or -1: no memory. */
int ml_attach_publish(ml_attach *a, const char *json, size_t len);

/* Wait until a control request is queued or timeout_ms pass. */
void ml_attach_wait(ml_attach *a, long long timeout_ms);

/* The oldest queued control request: 1 with its client and its line (len
 * bytes, valid until ml_attach_drop), or 0 when none. */
int ml_attach_peek(ml_attach *a, int *client, const char **code, size_t *len);

/* Drop the request ml_attach_peek returned. */
void ml_attach_drop(ml_attach *a);

/* The clients attached now (a refused peer never counts). */
int ml_attach_clients(ml_attach *a);

/* Queue text (len bytes, no NUL) as the reply to `client`; the server
 * thread sends it with its end and then reads that client's next line.
 * 1, 0 when the client is gone, -1: no memory. */
int ml_attach_reply(ml_attach *a, long long client, const char *text, size_t len);

#endif
