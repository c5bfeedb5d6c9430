"""Agent Ledger settings: one module, every value read from the environment.

docs/configuration.md lists each variable with its default. A bad value raises ImproperlyConfigured
naming the variable, so start-up stops instead of running with a guess.
"""

import hashlib
import warnings
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.env import env_bool, env_float, env_int, env_list, env_rate, env_str
from config.lib.crypto import check_keys, derived_key
from config.lib.redact import redact

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)


def _secret_key() -> str:
    """SECRET_KEY from the environment; without one, a development key, and only under DEBUG.

    Every web process and worker of a deployment must share one key (sessions, password resets
    and django-q2's signed task payloads depend on it), so a key each host invents for itself is
    refused: production sets SECRET_KEY. Under DEBUG a key kept under VAR_DIR by an earlier
    version is reused (sessions survive), else one derived from the checkout's path, which is
    stable across processes and writes nothing.
    """
    configured = env_str("SECRET_KEY", "")
    if configured:
        return configured
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set: set SECRET_KEY to a long random value shared by every web process "
            "and worker (e.g. the output of `python -c 'import secrets; print(secrets.token_urlsafe(50))'`), "
            "or set DEBUG=true for a development key."
        )
    try:
        return (VAR_DIR / "secret_key").read_text().strip()
    except OSError:
        pass
    return "django-insecure-dev-" + hashlib.sha256(str(BASE_DIR).encode()).hexdigest()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# --- HTTPS and cookies (all off by default: on for any deployment served over HTTPS) -----------

SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
# Behind a TLS-terminating proxy: "HTTP_X_FORWARDED_PROTO,https" trusts that header (only set it
# when the proxy always overwrites it, or any client could claim HTTPS).
_proxy_ssl_header = env_list("SECURE_PROXY_SSL_HEADER", [])
if _proxy_ssl_header and len(_proxy_ssl_header) != 2:
    raise ImproperlyConfigured(
        f"SECURE_PROXY_SSL_HEADER={','.join(_proxy_ssl_header)!r} must be a header and a value, comma "
        "separated, e.g. HTTP_X_FORWARDED_PROTO,https."
    )
SECURE_PROXY_SSL_HEADER = tuple(_proxy_ssl_header) if _proxy_ssl_header else None
# The debug page and error mails never show DATABASE_URL or any URL's password.
DEFAULT_EXCEPTION_REPORTER_FILTER = "config.lib.errors.SecretHidingReporterFilter"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_q",
    "axes",
    "runs",
    "agents",
    "memory",
]

MIDDLEWARE = [
    # First: nothing below reads a body the limit refuses, or a query string it cannot store.
    "config.lib.limits.body_limit_middleware",
    "config.lib.query_guard.query_guard_middleware",
    # Before anything reads the Host: the API's answer to an unknown one is JSON, under DEBUG too.
    "config.lib.host_guard.host_guard_middleware",
    # Around the rest: django-prometheus times every request (its metrics are served at /metrics).
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "config.lib.csp.csp_middleware",
    "config.lib.errors.APIErrorMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
    # Last, as django-axes asks: it answers for locked-out logins.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------

SQLITE_BUSY_TIMEOUT_MS = env_int("SQLITE_BUSY_TIMEOUT_MS", 30_000, minimum=0)
_default_database_url = f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
DATABASE_URL = env_str("DATABASE_URL", _default_database_url)
try:
    _database = dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)
except Exception as exc:  # dj-database-url raises several types for a bad URL
    raise ImproperlyConfigured(
        f"DATABASE_URL={redact(DATABASE_URL)!r} is not a usable database URL: {redact(str(exc))}"
    ) from None

if _database["ENGINE"] == "django.db.backends.sqlite3":
    if not _database.get("NAME") or _database["NAME"] == ":memory:":
        raise ImproperlyConfigured(
            "DATABASE_URL must name a SQLite file: the web server, the worker and ADK's own "
            "engine share it, which an in-memory database cannot do."
        )
    _database["OPTIONS"] = {
        # WAL lets readers proceed while the worker writes; IMMEDIATE takes the write lock at
        # BEGIN so read-then-write services serialise instead of failing with "database is locked".
        "init_command": (
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; "
            f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS};"
        ),
        "transaction_mode": "IMMEDIATE",
        "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
    }
    # A file, not memory: ADK's engine and child processes must reach the test database too.
    # Named after the main file, so two checkouts (or two DATABASE_URLs) never share one.
    _main_file = Path(_database["NAME"])
    _database["TEST"] = {"NAME": str(_main_file.with_name(f".test-{_main_file.name}"))}
elif _database["ENGINE"] == "django.db.backends.postgresql":
    pass
else:
    raise ImproperlyConfigured(
        f"DATABASE_URL={redact(DATABASE_URL)!r}: Agent Ledger runs on SQLite or PostgreSQL only."
    )

DATABASES = {"default": _database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ADK's DatabaseSessionService keeps its own SQLAlchemy pool on the same database.
# ADK's pool per worker process grows with the runs it keeps in flight: a run holds a connection
# only while it appends an event, so one per ten runs (at least 3), and as many again in bursts.
_RUN_CONCURRENCY_FOR_POOL = env_int("RUN_CONCURRENCY", 100, minimum=1)
ADK_DB_POOL_SIZE = env_int("ADK_DB_POOL_SIZE", max(3, _RUN_CONCURRENCY_FOR_POOL // 10), minimum=1)
ADK_DB_MAX_OVERFLOW = env_int("ADK_DB_MAX_OVERFLOW", max(2, _RUN_CONCURRENCY_FOR_POOL // 10), minimum=0)
ADK_DB_POOL_RECYCLE_SECONDS = env_int("ADK_DB_POOL_RECYCLE_SECONDS", 300, minimum=1)
# PostgreSQL: an event without function calls commits with synchronous_commit off; a function
# call's event (its journal row), effect records and the settle always wait for the disk
# (agents.session_sql.commit_may_lag, docs/scale.md, "Durability and commits").
EVENT_COMMITS_MAY_LAG = env_bool("EVENT_COMMITS_MAY_LAG", True)

CACHES = {
    # django-q2 writes cluster stats every half second: keep that off the database.
    "default": {
        "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
        "LOCATION": str(VAR_DIR / "cache"),
    }
}

# --- Auth, i18n, static ------------------------------------------------------------------------

AUTHENTICATION_BACKENDS = [
    # django-axes first: it refuses a locked-out login before any password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# The admin's Content-Security-Policy (config/lib/csp.py); `off` sends none.
_ADMIN_CSP_DEFAULT = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
ADMIN_CONTENT_SECURITY_POLICY = env_str("ADMIN_CONTENT_SECURITY_POLICY", _ADMIN_CSP_DEFAULT)
if ADMIN_CONTENT_SECURITY_POLICY.lower() in {"off", "none"}:
    ADMIN_CONTENT_SECURITY_POLICY = ""
elif any(ord(char) < 0x20 or ord(char) > 0x7E for char in ADMIN_CONTENT_SECURITY_POLICY) or (
    "-src" not in ADMIN_CONTENT_SECURITY_POLICY and "frame-ancestors" not in ADMIN_CONTENT_SECURITY_POLICY
):
    raise ImproperlyConfigured(
        "ADMIN_CONTENT_SECURITY_POLICY is not a Content-Security-Policy: write directives in printable ASCII "
        "(e.g. \"default-src 'self'\"), or off for none."
    )

# Django's two upload handlers, keeping the name a client sent whole (config/lib/uploads.py).
FILE_UPLOAD_HANDLERS = [
    "config.lib.uploads.NameKeepingMemoryFileUploadHandler",
    "config.lib.uploads.NameKeepingTemporaryFileUploadHandler",
]

# Failed admin logins (config/lib/lockout.py): after AXES_FAILURE_LIMIT failures for one username
# from one address, or AXES_ADDRESS_FAILURE_LIMIT failures from one address over any usernames (one
# password sprayed over many accounts), logins from there are locked out for AXES_COOLOFF_HOURS
# (a success resets the count).
AXES_ENABLED = env_bool("AXES_ENABLED", True)
LOGIN_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
LOGIN_ADDRESS_FAILURE_LIMIT = env_int("AXES_ADDRESS_FAILURE_LIMIT", 20, minimum=1)
AXES_FAILURE_LIMIT = "config.lib.lockout.failure_limit"
AXES_COOLOFF_TIME = env_float("AXES_COOLOFF_HOURS", 1.0, minimum=0.01)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"], "ip_address"]
AXES_RESET_ON_SUCCESS = True
# The address a lockout is keyed on: REMOTE_ADDR, or behind N trusted proxies the N-th from the
# right of X-Forwarded-For.
AXES_IPWARE_PROXY_COUNT = env_int("AXES_PROXY_COUNT", None, minimum=1)
# django-ipware is not installed, so axes would read REMOTE_ADDR only: the address comes from here.
AXES_CLIENT_IP_CALLABLE = "config.lib.client_ip.client_ip"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "static")))
# Importing settings writes nothing; WhiteNoise serves from the apps (finders) until collectstatic
# fills STATIC_ROOT, and would otherwise warn on every start that the folder is missing.
warnings.filterwarnings("ignore", message="No directory at", category=UserWarning)
# Served by WhiteNoise straight from the apps, so no collectstatic step is needed to run.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# By default sent mail is written to files under VAR_DIR/mail (0600 in a 0700 folder): visible to
# the service's account, and never delivered.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "config.lib.mail.PrivateFileEmailBackend")
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "support@agent-ledger.local")

# `json` writes one JSON object a line (for a log shipper); every line carries the run id of
# the run it was logged in (config.lib.observability).
LOG_FORMAT = env_str("LOG_FORMAT", "plain")
if LOG_FORMAT not in {"plain", "json"}:
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r} must be plain or json.")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"run_id": {"()": "config.lib.observability.RunIdLogFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [run %(run_id)s]: %(message)s"},
        "json": {"()": "config.lib.observability.JsonLinesFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["run_id"]}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        # ADK logs a full traceback for every failed run; the run row already records the
        # failure in words, so the worker's log stays readable by default.
        "google_adk": {"level": env_str("ADK_LOG_LEVEL", "CRITICAL")},
        "google_genai": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "axes": {"level": "WARNING"},
    },
}

# --- Runs ---------------------------------------------------------------------------------------

RUN_INPUTS_DIR = Path(env_str("RUN_INPUTS_DIR", str(VAR_DIR / "run-inputs")))
MAX_UPLOAD_BYTES = env_int("MAX_UPLOAD_BYTES", 25 * 1024 * 1024, minimum=1)
# Every other request body (JSON, forms) is refused past this, before it is read
# (config/lib/limits.py); uploads to POST /api/runs/ and webhook deliveries have their own limits.
MAX_REQUEST_BODY_BYTES = env_int("MAX_REQUEST_BODY_BYTES", 2_621_440, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
# Stored copies are private to the service's account (config/lib/files.py).
FILE_UPLOAD_PERMISSIONS = 0o600
FILE_UPLOAD_DIRECTORY_PERMISSIONS = 0o700
# Where uploads larger than FILE_UPLOAD_MAX_MEMORY_SIZE are spooled while they arrive (default:
# the system's temp directory).
FILE_UPLOAD_TEMP_DIR = env_str("FILE_UPLOAD_TEMP_DIR", "") or None
MAX_MESSAGE_CHARS = env_int("MAX_MESSAGE_CHARS", 100_000, minimum=1)
RUN_HEARTBEAT_SECONDS = env_float("RUN_HEARTBEAT_SECONDS", 10.0, minimum=0.05)
RUN_STALE_AFTER_SECONDS = env_int("RUN_STALE_AFTER_SECONDS", 60, minimum=1)
RUN_MAX_SILENCE_HOURS = env_int("RUN_MAX_SILENCE_HOURS", 6, minimum=1)
# A call that waits for a person (or a long-running tool's result) longer than this is rejected by the system.
APPROVAL_TIMEOUT_SECONDS = env_int("APPROVAL_TIMEOUT_SECONDS", 259_200, minimum=1)
# A confirmation stands for a second person: whoever started a run may not approve its calls unless this is true.
APPROVAL_BY_STARTER_ALLOWED = env_bool("APPROVAL_BY_STARTER_ALLOWED", False)
RUN_TIMEOUT_SECONDS = env_int("RUN_TIMEOUT_SECONDS", 1800, minimum=1)
# Runs one worker process keeps in flight on its agent loop (runs.worker.processes); it claims another run
# from the ledger only when one of these slots is free.
RUN_CONCURRENCY = env_int("RUN_CONCURRENCY", 100, minimum=1)
# Worker processes `manage.py runworker` starts on this machine (each up to RUN_CONCURRENCY runs).
RUN_WORKER_PROCESSES = env_int("RUN_WORKER_PROCESSES", 2, minimum=1)
# How often an idle worker process looks for claimable runs and events without being told: the
# only way on SQLite; on PostgreSQL a NOTIFY wakes it at once and this bounds a lost one's delay.
RUN_POLL_SECONDS = env_float("RUN_POLL_SECONDS", 2.0, minimum=0.05)
# Each worker process LISTENs on one dedicated PostgreSQL connection (and holds its advisory lock
# there, so other machines see its death at once). Off where no session can be held (a pooler in
# transaction mode): workers then poll, and a lost machine is found by staleness.
RUN_LISTEN = env_bool("RUN_LISTEN", True)
# The machine's name in the claims of its worker processes (`WORKER_HOST:pid/worker`); empty: the hostname.
WORKER_HOST = env_str("WORKER_HOST", "")
# On SIGTERM a worker lets its runs finish this long, then aborts the rest (`worker_shutdown`).
RUN_DRAIN_SECONDS = env_float("RUN_DRAIN_SECONDS", 30.0, minimum=0)
# A run that died (reconciled, or aborted by a drain) is continued by the system as a resume when
# its resume decision needs no person (runs.upkeep.recovery): `resume` (the default) or `off`.
RUN_RECOVERY = env_str("RUN_RECOVERY", "resume").lower()
if RUN_RECOVERY not in ("resume", "off"):
    raise ImproperlyConfigured(f"RUN_RECOVERY={RUN_RECOVERY!r} must be resume or off.")
RUN_RECOVERY_ATTEMPTS = env_int("RUN_RECOVERY_ATTEMPTS", 3, minimum=0)
# The wait before the system's second continuation of a chain; it doubles for each later one.
RUN_RECOVERY_BACKOFF_SECONDS = env_float("RUN_RECOVERY_BACKOFF_SECONDS", 5.0, minimum=0)
EVENTS_RETENTION_DAYS = env_int("EVENTS_RETENTION_DAYS", 90, minimum=1)
PURGE_BATCH_SIZE = env_int("PURGE_BATCH_SIZE", 5000, minimum=1)
if PURGE_BATCH_SIZE > 100_000:  # runs.upkeep.retention.MAX_BATCH_SIZE
    raise ImproperlyConfigured(
        f"PURGE_BATCH_SIZE={PURGE_BATCH_SIZE} is too large: at most 100000 events per batch keeps "
        "each purge transaction short."
    )

if RUN_STALE_AFTER_SECONDS <= RUN_HEARTBEAT_SECONDS * 2:
    raise ImproperlyConfigured(
        f"RUN_STALE_AFTER_SECONDS={RUN_STALE_AFTER_SECONDS} must be more than twice "
        f"RUN_HEARTBEAT_SECONDS={RUN_HEARTBEAT_SECONDS}, or live runs would be reconciled."
    )

# --- Agents -------------------------------------------------------------------------------------

# Agent packages in `adk web`'s layout (<dir>/<name>/agent.py, …), comma-separated; the first
# directory that has a name wins. They are imported on first use, never at settings import.
AGENTS_DIR = env_list("AGENTS_DIR", [str(BASE_DIR / "agents" / "bundled")])
# ADK's loader would read a `.env` from each package's folder upwards (to `/`) into the process
# environment, so a file planted above a package could rewrite this deployment: off unless asked.
AGENTS_LOAD_DOTENV = env_bool("AGENTS_LOAD_DOTENV", False)
# How long listing one MCP server's tools may take when the agents are loaded.
AGENT_TOOL_LISTING_TIMEOUT_SECONDS = env_float("AGENT_TOOL_LISTING_TIMEOUT_SECONDS", 20.0, minimum=1)

GOOGLE_API_KEY = env_str("GOOGLE_API_KEY", "")
# "scripted" plays each run's script offline; "" (the default with a key) lets every agent keep
# the model it declares; any other name replaces every agent's model. Without a key the offline
# model is the default only under DEBUG: a production server with neither a key nor an explicit
# AGENT_MODEL=scripted refuses to start rather than play demo scripts to real owners.
AGENT_MODEL = env_str("AGENT_MODEL", "" if GOOGLE_API_KEY else ("scripted" if DEBUG else ""))
if not AGENT_MODEL and not GOOGLE_API_KEY:
    raise ImproperlyConfigured(
        "No model is configured: set GOOGLE_API_KEY for real models, or AGENT_MODEL=scripted to run "
        "the offline scripted model on purpose (it is the default only with DEBUG=true)."
    )
if AGENT_MODEL != "scripted" and not GOOGLE_API_KEY:
    raise ImproperlyConfigured(
        f"AGENT_MODEL={AGENT_MODEL!r} needs GOOGLE_API_KEY; unset AGENT_MODEL to use the offline "
        "scripted model."
    )
# Whether the scripted model plays an agent package's DEFAULT_SCRIPT(S) to a run that brings no
# script of its own: the demo's, so on only under DEBUG unless set (a run without a script then
# answers that it has nothing more to add, and calls no tool).
SCRIPTED_DEFAULT_SCRIPTS = env_bool("SCRIPTED_DEFAULT_SCRIPTS", DEBUG)
# Scripted tool faults (crash, hang, tool_fails) are for tests and demos: only when set
# explicitly, and a crash is never honoured in a web process (chat turns run there).
SCRIPTED_FAULTS_ENABLED = env_bool("SCRIPTED_FAULTS_ENABLED", False)
# Whether API users (POST /api/runs/, POST /api/chat/) may send `params.script`: a script makes
# the offline model call any tool with any arguments.
SCRIPTS_FROM_USERS_ALLOWED = env_bool("SCRIPTS_FROM_USERS_ALLOWED", False)
# MCP servers whose readOnlyHint / idempotentHint count (names, commands or URLs); any other
# server's tools are effectful whatever they claim.
MCP_TRUSTED_SERVERS = env_list("MCP_TRUSTED_SERVERS", [])
# The memory diet: base64 strings at least this long in old function responses are stripped
# from model requests. Shorter ones are ids and tokens, not payloads, hence the floor.
STRIP_PAYLOAD_MIN_CHARS = env_int("STRIP_PAYLOAD_MIN_CHARS", 4000, minimum=256)

# --- Long-term memory -----------------------------------------------------------------------------

# Unset keeps memories for ever; N prunes memories older than N days in the daily job.
MEMORY_RETENTION_DAYS = env_int("MEMORY_RETENTION_DAYS", None, minimum=1)
# How many memories one search returns (and `preload_memory` puts in front of the model).
MEMORY_SEARCH_RESULTS = env_int("MEMORY_SEARCH_RESULTS", 10, minimum=1)

# Retries at the model-call boundary (agents/retrying.py, its table of answers): a model call is
# sent again only while nothing from it has reached the agent, so no tool can run twice.
MODEL_RATE_LIMIT_RETRIES = env_int("MODEL_RATE_LIMIT_RETRIES", 2, minimum=0)
MODEL_RETRY_BASE_DELAY_SECONDS = env_float("MODEL_RETRY_BASE_DELAY_SECONDS", 1.0, minimum=0)
MODEL_RETRY_MAX_WAIT_SECONDS = env_float("MODEL_RETRY_MAX_WAIT_SECONDS", 60.0, minimum=0)
# Empty turns and answers that stopped without a usable result (OTHER, MALFORMED_FUNCTION_CALL, …).
EMPTY_TURN_RETRIES = env_int("EMPTY_TURN_RETRIES", 1, minimum=0)
# 5xx, a lost connection, a body that is not JSON, no answer within MODEL_TIMEOUT_SECONDS.
MODEL_FAULT_RETRIES = env_int("MODEL_FAULT_RETRIES", 2, minimum=0)
# How long one model call may take (each streamed chunk, when streaming) before it counts as lost.
MODEL_TIMEOUT_SECONDS = env_float("MODEL_TIMEOUT_SECONDS", 120.0, minimum=0.1)

# Chat turns streamed as server-sent events: a comment line keeps idle proxies from closing
# the stream while a tool works.
CHAT_KEEPALIVE_SECONDS = env_float("CHAT_KEEPALIVE_SECONDS", 15.0, minimum=0.1)

# --- The webhook inbox ---------------------------------------------------------------------------

# Fernet keys (comma-separated, newest first) that encrypt stored webhook secrets
# (config/lib/crypto.py); unset, one key derived from SECRET_KEY.
SECRETS_ENCRYPTION_KEYS = check_keys(env_list("SECRETS_ENCRYPTION_KEYS", []) or [derived_key(SECRET_KEY)])
# Largest JSON body `POST /api/webhooks/<source>/` accepts (attachments included, base64).
WEBHOOK_MAX_BYTES = env_int("WEBHOOK_MAX_BYTES", 10 * 1024 * 1024, minimum=1024)
WEBHOOK_ATTACHMENTS_DIR = Path(env_str("WEBHOOK_ATTACHMENTS_DIR", str(VAR_DIR / "webhook-attachments")))
# How far a timestamped signature's time may be from this server's clock, into the past (a captured
# delivery sent again later) or the future (the sender's clock ahead), in seconds.
WEBHOOK_SIGNATURE_TOLERANCE_SECONDS = env_int("WEBHOOK_SIGNATURE_TOLERANCE_SECONDS", 300, minimum=1)
# Runs started for one event before it is `dead` (only attempts that provably called no tool
# are retried automatically).
WEBHOOK_MAX_ATTEMPTS = env_int("WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
# Seconds to wait before retry 1, 2, 3 …; the last value repeats (the cap).
_retry_delays = env_list("WEBHOOK_RETRY_DELAYS", ["5", "30", "120", "600", "1800", "3600"])
try:
    WEBHOOK_RETRY_DELAYS = [int(value) for value in _retry_delays]
except ValueError:
    raise ImproperlyConfigured(
        f"WEBHOOK_RETRY_DELAYS={','.join(_retry_delays)!r} must be whole numbers of seconds, comma separated."
    ) from None
if not WEBHOOK_RETRY_DELAYS or min(WEBHOOK_RETRY_DELAYS) < 0:
    raise ImproperlyConfigured("WEBHOOK_RETRY_DELAYS must list at least one delay, none negative.")
# How long a worker's claim on an event lasts without renewal; a worker renews it while it works,
# so an expired lease means the worker is gone and another may take the event.
WEBHOOK_LEASE_SECONDS = env_int("WEBHOOK_LEASE_SECONDS", 90, minimum=1)

# --- Retention of stored inputs ----------------------------------------------------------------

# 0 keeps them for ever. Only what belongs to settled runs and closed events is ever removed.
# Webhook events (rows and attachment copies) closed (done, resolved, dead) this many days ago:
WEBHOOK_EVENTS_RETENTION_DAYS = env_int("WEBHOOK_EVENTS_RETENTION_DAYS", 90, minimum=0)
# Attachment copies of closed webhook events, which may go sooner than the event rows:
WEBHOOK_ATTACHMENTS_RETENTION_DAYS = env_int("WEBHOOK_ATTACHMENTS_RETENTION_DAYS", 30, minimum=0)
# Input-file copies of runs that settled this many days ago (after which a replay is `input_gone`):
RUN_INPUTS_RETENTION_DAYS = env_int("RUN_INPUTS_RETENTION_DAYS", 90, minimum=0)

# --- Background jobs (django-q2 on the ORM broker) -----------------------------------------------

# The periodic jobs only (reconcile and recover, purges, schedules, approval expiry, webhook
# sweeps): runs are claimed from the ledger by `runworker`, never passed through django-q2.
Q_WORKERS = env_int("Q_WORKERS", 1, minimum=1)
# A purge or a sweep of a large backlog may take minutes; `retry` must exceed `timeout` or a long
# job is delivered twice while it still runs. Every job is idempotent regardless.
_task_timeout = 600
Q_CLUSTER = {
    "name": "agentledger",
    "orm": "default",
    "workers": Q_WORKERS,
    "timeout": _task_timeout,
    "retry": _task_timeout + 120,
    "max_attempts": 3,
    "ack_failures": False,
    "catch_up": False,
    "save_limit": 1000,
    "poll": env_float("Q_POLL_SECONDS", 0.5, minimum=0.05),
    "sync": env_bool("Q_SYNC", False),
    "label": "Background jobs",
}

# --- Operating it: metrics and traces ------------------------------------------------------------

# /metrics (Prometheus) answers only when enabled, to a bearer token or a staff login.
METRICS_ENABLED = env_bool("METRICS_ENABLED", False)
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
# Spans (ADK's, Django's requests, one per run) go over OTLP/HTTP when an endpoint is set; the
# exporter also reads the other standard OTEL_EXPORTER_OTLP_* variables (headers, timeout).
OTEL_EXPORTER_OTLP_ENDPOINT = env_str("OTEL_EXPORTER_OTLP_ENDPOINT", "")
OTEL_SERVICE_NAME = env_str("OTEL_SERVICE_NAME", "agent-ledger")

# --- API ----------------------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "config.lib.auth.ExpiringTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "config.lib.api_errors.api_exception_handler",
    # One strict JSON reading for every API view (config/lib/safe_json.py).
    "DEFAULT_PARSER_CLASSES": [
        "config.lib.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
}

# API tokens are refused (401 token_expired) this many days after they were made; 0 keeps them.
API_TOKEN_TTL_DAYS = env_int("API_TOKEN_TTL_DAYS", 90, minimum=0)

# Requests per user (config/lib/throttles.py); `off` lifts a limit. 429 with Retry-After past it.
THROTTLE_RATES = {
    "runs.start": env_rate("THROTTLE_RUNS_START", "120/min"),
    "runs.replay": env_rate("THROTTLE_REPLAYS", "60/min"),
    "chat.turn": env_rate("THROTTLE_CHAT_TURNS", "60/min"),
    # Failed token authentications per client address (config/lib/auth.py): guessing keys is paced.
    "auth.failed_token": env_rate("THROTTLE_FAILED_TOKENS", "20/min"),
}
# Work in flight per user (runs/rules/quotas.py); 0 lifts a cap.
MAX_RUNS_IN_FLIGHT_PER_USER = env_int("MAX_RUNS_IN_FLIGHT_PER_USER", 100, minimum=0)
MAX_CHAT_STREAMS_PER_USER = env_int("MAX_CHAT_STREAMS_PER_USER", 5, minimum=0)

# The OpenAPI schema and its docs page need a signed-in user unless this is set.
API_SCHEMA_PUBLIC = env_bool("API_SCHEMA_PUBLIC", False)

SPECTACULAR_SETTINGS = {
    "TITLE": "Agent Ledger API",
    "DESCRIPTION": "Durable ADK agent runs with safe replays.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["config.lib.schema.SchemaAccess"],
    # The docs page's assets are served from the sidecar package, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # The chat turn streams (text/event-stream) from a plain async view, which DRF cannot describe.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "runs.api.chat.add_chat_to_schema",
        # Any authenticated operation may answer 429 to an address guessing tokens (config/lib/auth.py).
        "config.lib.auth.add_auth_pacing_to_schema",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runs.models.ledger.RunStatus",
        "ToolCallStatusEnum": "runs.models.ledger.ToolCallStatus",
        "TriggerEnum": "runs.models.ledger.Trigger",
        "SettledOutcomeEnum": "runs.models.ledger.SettledOutcome",
        "EffectsEnum": "runs.models.ledger.EffectsChoice",
        "CallDecisionEnum": "runs.models.approvals.Decision",
        "PersonDecisionEnum": "runs.models.approvals.PERSON_DECISIONS",
    },
}
