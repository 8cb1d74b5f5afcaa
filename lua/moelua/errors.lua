-- moelua.errors: user errors, told apart from bugs.
--
-- A user error (a bad option or value, a run directory that holds another
-- run, a budget the machine cannot hold, Ctrl-C during training) is a
-- table with a __tostring metamethod. The host prints such an error as its
-- message alone (host/bindings/main.c: the message handler of lua.c takes the
-- __tostring of a non-string error and adds no traceback), unless it runs
-- with `moelua --traceback`; any other error is a bug and keeps its
-- traceback. tostring(err) gives the message, so code that matches on the
-- text of a caught error works for both kinds.
--
--   local errors = require "moelua.errors"
--   errors.user("option --steps must be at least 1, got 0")   -- raises
--   if errors.is_user(err) then ... end
local errors = {}

local UserError = {__name = "moelua.UserError"}
function UserError.__tostring(e) return e.message end
-- "..": a user error still concatenates like the string it stands for
function UserError.__concat(a, b) return tostring(a) .. tostring(b) end

-- Raise msg (a string) as a user error. The message is complete as it is:
-- no position is added (ml_user_error in C prepends the binding's own).
function errors.user(msg)
  if type(msg) ~= "string" then error("moelua.errors.user: expected a message string", 2) end
  error(setmetatable({message = msg}, UserError), 0)
end

-- Raise msg as a user error that every rank raises at the same point,
-- having agreed on it in a collective (moelua.train's stop after a
-- Ctrl-C): under mpiexec rank 0 prints it and the ranks end through
-- MPI_Finalize, not MPI_Abort (host/bindings/main.c); an error one rank
-- raises alone must stay errors.user, whose MPI_Abort frees the others.
function errors.agreed(msg)
  if type(msg) ~= "string" then error("moelua.errors.agreed: expected a message string", 2) end
  error(setmetatable({message = msg, agreed = true}, UserError), 0)
end

function errors.is_user(e) return getmetatable(e) == UserError end

-- errors.written(what, f:write(...)) or errors.written(what, f:flush()):
-- a failed write (a full disk, a closed pipe: moelua takes SIGPIPE as an
-- error) is a user error "what: reason"; else returns the file.
function errors.written(what, f, reason)
  if not f then errors.user(what .. ": " .. tostring(reason)) end
  return f
end

return errors
