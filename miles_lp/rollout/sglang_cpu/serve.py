"""``python -m miles_lp.rollout.sglang_cpu.serve SGLANG_FLAGS...``: SGLang's own ``launch_server`` with miles-lp's
additions (``hook``), in SGLang's venv. Run by ``launch.SGLangCPUServer``; also the command for a server started by
hand that ``rollout.url`` then names (same flags as ``python -m sglang.launch_server``; needs
``SGLANG_USE_CPU_ENGINE=1`` and ``miles_lp/rollout/sglang_cpu/shim`` on PYTHONPATH on a CPU host).

``use_runtime_from_env()`` and ``hook.install()`` run at import, on purpose: SGLang's scheduler is a spawned child that imports this module
again (as ``__mp_main__``) before it loads the model.
"""

from __future__ import annotations

import sys

from miles_lp.config import use_runtime_from_env
from miles_lp.rollout.sglang_cpu import hook

use_runtime_from_env()  # the run's runtime: section (MILES_LP_RUNTIME from SGLangCPUServer), in every SGLang process
hook.install()


def main(argv: list[str]) -> None:
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import prepare_server_args

    hook.prepare_env()
    hook.add_routes(app)
    launch_server(prepare_server_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
