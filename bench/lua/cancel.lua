-- wrk script: DELETE /timer/<id> for ids made from a pattern and a counter: id_format % (start + n).
-- Arguments (after "--"): id_format  start  limit
--   id_format: a string.format pattern such as "b-%d", or "@<file>": the ids are that file's lines,
--              taken in order from line start + 1.
--   limit: send only that many DELETEs, then pings (the ids beyond it were never created).
-- Run with -t1 so that every connection shares one counter (one Lua state per thread).
local id_format, start, limit
local ids  -- with id_format "@<file>": the file's lines
local n = 0
local idle
local idles = 0
local verified = false

function init(args)
   idle = wrk.format("GET", "/ping")
   id_format = args[1]
   start = tonumber(args[2])
   limit = tonumber(args[3])
   if string.sub(id_format, 1, 1) == "@" then
      ids = {}
      for line in io.lines(string.sub(id_format, 2)) do ids[#ids + 1] = line end
   end
end

function request()
   -- wrk calls request() once in this thread's Lua state before the run, to check the request
   -- (script_verify_request); that request is never sent, so it must not use up an id.
   if not verified then
      verified = true
      return idle
   end
   if n >= limit then
      -- Past the limit every connection sends cheap pings, so the requests still in flight get
      -- answered; once each connection has had its turn, stop (closing a connection with a request
      -- in flight could lose that request). The driver stops wrk when the node has counted them all.
      idles = idles + 1
      if idles > 256 then wrk.thread:stop() end
      return idle
   end
   local id
   if ids then id = ids[start + n + 1] else id = string.format(id_format, start + n) end
   local path = "/timer/" .. id
   n = n + 1
   return wrk.format("DELETE", path)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRKJSON {"requests":%d,"duration_us":%d,"err_connect":%d,"err_read":%d,"err_write":%d,' ..
      '"err_status":%d,"err_timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d}\n',
      summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
      latency.max))
end
