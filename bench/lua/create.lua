-- wrk script: POST /timer with a fixed JSON body.
-- Arguments (after "--"): timeout_ms  data_json  callback_uri  [id_format]  [limit]
--   id_format: a string.format pattern such as "b-%d" for client-chosen ids (x-timer-id);
--              "" or "-" lets the server pick a uuid.
--   limit:     send only that many POSTs, then pings (0 = POST for the whole duration).
-- Run with -t1 so that every connection shares one counter (one Lua state per thread).
local body, fixed, id_format
local n, limit = 0, 0
local headers = { ["Content-Type"] = "application/json" }
local idle
local idles = 0
local verified = false

function init(args)
   idle = wrk.format("GET", "/ping")
   local timeout, data, uri = args[1], args[2], args[3]
   id_format = args[4]
   if id_format == "" or id_format == "-" then id_format = nil end
   limit = tonumber(args[5] or "0") or 0
   body = string.format('{"timeout":%s,"data":%s,"callback":{"transport":"http","method":"post","uri":"%s"}}',
                        timeout, data, uri)
   fixed = wrk.format("POST", "/timer", headers, body)
end

function request()
   -- wrk calls request() once in this thread's Lua state before the run, to check the request
   -- (script_verify_request); that request is never sent, so it must not use up an id.
   if not verified then
      verified = true
      return idle
   end
   if limit > 0 and n >= limit then
      -- Past the limit every connection sends cheap pings, so the requests still in flight get
      -- answered; once each connection has had its turn, stop (closing a connection with a request
      -- in flight could lose that request). The driver stops wrk when the node has counted them all.
      idles = idles + 1
      if idles > 256 then wrk.thread:stop() end
      return idle
   end
   n = n + 1
   if id_format == nil then return fixed end
   headers["x-timer-id"] = string.format(id_format, n - 1)
   return wrk.format("POST", "/timer", headers, body)
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
