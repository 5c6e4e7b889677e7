"""SGLang on its CPU platform, driven by miles-lp: ``launch`` (start / stop a server), ``serve`` (the module the
server runs as), ``hook`` + ``introspect`` (the checks answered inside SGLang), ``shim`` (two ``sgl_kernel`` ops in
torch). Only ``launch`` runs in miles-lp's own process; the others run in SGLang's venv."""
