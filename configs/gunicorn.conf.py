# gunicorn settings for the colibri OpenAI-compatible HTTP gateway (colibri_server/http/).
#
#   COLIBRI_HTTP_CONNECT=tcp://127.0.0.1:5555 \
#       gunicorn 'colibri_server.http:app_from_env()' -c configs/gunicorn.conf.py
#
# (or `gunicorn -c configs/gunicorn.conf.py` alone: wsgi_app below names the factory).
# (several routers, one per machine: COLIBRI_HTTP_CONNECT=tcp://10.0.0.1:5555,tcp://10.0.0.2:5555)
# The app reads its options from the environment: COLIBRI_HTTP_CONNECT, COLIBRI_HTTP_API_KEY
# or COLIBRI_HTTP_API_KEY_FILE, COLIBRI_HTTP_MODEL_NAME, COLIBRI_HTTP_TIMEOUT,
# COLIBRI_HTTP_MAX_BODY, COLIBRI_HTTP_DEFAULT_MAX_TOKENS, COLIBRI_HTTP_METRICS_AUTH,
# COLIBRI_HTTP_CURVE_SERVERKEY, COLIBRI_HTTP_PAGES.  This file reads COLIBRI_HTTP_BIND, _WORKERS, _THREADS, _ACCESS_LOG and
# _LOG_LEVEL, every one a gateway setting of colibri_server/settings/schema.py (type, bound, default).
# Command-line flags (--bind, --workers, ...) override what is set here.
from colibri_server.settings.schema import gateway_value

wsgi_app = "colibri_server.http:app_from_env()"

bind = gateway_value("bind")

# gthread: each thread serves one request at a time and keeps its own colibri Client
# (a Client is not thread-safe).  The gateway only waits on ZeroMQ: threads are cheap, and
# `threads` bounds the concurrent HTTP requests (streams included) of one process.
# colibri's gthread: a connection gets a thread only once its whole request (head and body,
# whatever the framing) is in, within COLIBRI_HTTP_HEADER_TIMEOUT (default 10 s) of its first
# byte (then 408): idle or slow clients wait in the poller and cannot take the threads the API
# needs; GET /health and /metrics have two threads of their own.
worker_class = "colibri_server.http.HeadFirstWorker"
threads = gateway_value("threads")
# One process by default: request metrics are per process (see colibri_server/http/metrics.py).
workers = gateway_value("workers")

# gthread heartbeats from its main loop, so long streams do not trip this; it only catches a
# wedged worker process.
timeout = 120
graceful_timeout = 30
keepalive = 5

# request line / header limits (bodies are limited by the app: COLIBRI_HTTP_MAX_BODY)
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190

# gunicorn >= 24 opens a control socket at a fixed per-user path ($XDG_RUNTIME_DIR or
# ~/.gunicorn/gunicorn.ctl): two gateways on one host would fight over it; nothing uses it.
control_socket_disable = True

proc_name = "colibri-http"
errorlog = "-"
accesslog = gateway_value("access_log") or None
loglevel = gateway_value("log_level")
