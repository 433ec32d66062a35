"""The user-facing API: `LLM` (vLLM-like) and the one-shot `generate`."""
from __future__ import annotations

from typing import Callable, Sequence

import jax

from jaxpd.config import EngineConfig, resolve_dtype
from jaxpd.engine import elastic
from jaxpd.engine.engine import Engine
from jaxpd.engine.placement import role_shardings
from jaxpd import xla_cache
from jaxpd.frontend import Frontend
from jaxpd.model_registry import resolve_model
from jaxpd.outputs import CompletionOutput
from jaxpd.request import Request
from jaxpd.sampling_params import SamplingParams
from jaxpd.stats import EngineStats
from jaxpd.models import checkpoint
from jaxpd.sharding.spec import AUTO, auto_mesh
from jaxpd.transfer.connector import Connector, KVReceiver, KVSender


class LLM(Frontend):
    """Load a model, build the meshes, start the engine.

    model: a Hugging Face checkpoint directory, a .gguf file, a registered name
    (`jaxpd.model_registry.MODELS`, fetched once), a hub id, or None for the built-in default.
    mesh: "prefill=P,decode=D[xT]", "colocated=N", "elastic=N" or "auto" (the default:
    `sharding.spec.auto_mesh`, one device per role on CPU). warmup: compile every bucket now
    (reporting through `progress`) instead of on first use. dtype: "auto" (float32 on
    CPU, bfloat16 on TPU/GPU), "float32" or "bfloat16". connector: how KV moves (default:
    in-process `DevicePutConnector`; a cross-process sender or receiver for single-role
    meshes "prefill=P" / "decode=D"). compilation_cache_dir: keep compiled programs
    there and load them next time (`jaxpd.xla_cache`; None leaves jax as configured,
    e.g. by $JAX_COMPILATION_CACHE_DIR). plan: a prefill or decode role's mesh spans processes
    (`engine.multihost.PlanChannel`; `python -m jaxpd.launch --num_processes` sets it
    up). Other keyword arguments go to `EngineConfig` (page_size, max_model_len,
    slots_per_shard, ...).
    """

    def __init__(self, model: str | None = None, mesh: str = "auto",
                 dtype: str = "auto", warmup: bool = False,
                 progress: Callable[[str], None] | None = None,
                 connector: Connector | KVSender | KVReceiver | None = None,
                 compilation_cache_dir: str | None = None, plan=None, **engine_options):
        xla_cache.enable(compilation_cache_dir)
        if mesh == AUTO:
            mesh = auto_mesh(jax.devices()[0].platform, jax.device_count())
        # A mesh across processes: each process reads only the weight shards its
        # devices hold, straight onto the mesh.
        shardings = None if plan is None else lambda cfg: role_shardings(cfg, mesh)
        loaded = checkpoint.load(resolve_model(model), dtype="float32", shardings=shardings)
        self.weights_read = loaded.weights_read
        engine_options.setdefault("max_model_len", min(loaded.cfg.max_position_embeddings, 1024))
        self.config = EngineConfig(mesh=mesh, dtype=resolve_dtype(dtype, jax.default_backend()),
                                   **engine_options)
        if self.config.max_model_len > loaded.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={loaded.cfg.max_position_embeddings}")
        self.model_config = loaded.cfg
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(loaded, self.config, connector, warmup=warmup, progress=progress,
                             plan=plan)
        self.fingerprint = self.engine.fingerprint

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    def failure(self) -> BaseException | None:
        return self.engine.error

    def submit(self, request: Request) -> Request:
        return self.engine.submit(request)

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        return self.engine.abort(request_id, reason)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def resplit(self, prefill: int) -> elastic.Resplit:
        """An elastic mesh (`mesh="elastic=N"`): move devices so that the prefill mesh
        has `prefill` of them, while serving; every request is kept, and decoding ones
        keep their KV (`jaxpd.engine.elastic`)."""
        return elastic.resplit(self.engine, prefill, lambda msg: None)

    def prepare_resplit(self, prefill: int) -> float:
        """Build and compile the split `resplit(prefill)` moves to, now, while serving (it
        then only pauses for the move); returns the seconds it took."""
        return elastic.prepare(self.engine, prefill, lambda msg: None)

    def shutdown(self) -> None:
        self.engine.shutdown()


def generate(prompts: str | Sequence[str] | None = None,
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             mesh: str = "auto", model: str | None = None,
             prompt_token_ids: Sequence[Sequence[int]] | None = None,
             **options) -> list[CompletionOutput]:
    """One shot: build an `LLM`, generate, shut it down."""
    with LLM(model=model, mesh=mesh, **options) as llm:
        return llm.generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids)
