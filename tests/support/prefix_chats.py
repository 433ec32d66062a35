"""Multi-turn chats against transformers through a prefix-caching engine, and the
in-process workers prefix-caching router tests start."""
from concurrent import futures

from jaxpd import LLM, SamplingParams
from tests.engine_fixtures import assert_all_pages_free, wait_idle
from tests.hf_fixtures import hf_greedy


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def conversation(rng, turns, system_len=37):
    """A shared system prompt, then user turns of growing length (page boundaries
    crossed at every turn with page_size 16)."""
    system = rng.integers(3, 256, system_len).tolist()
    return system, [rng.integers(3, 256, 5 + 9 * t).tolist() for t in range(turns)]


def chat(llm, hf_model, system, users, max_tokens=6, **kw):
    """Run the conversation turn by turn; each turn's prompt is everything so far. Every
    answer equals transformers' greedy continuation of the same ids."""
    conv = list(system)
    for user in users:
        conv += user
        out = llm.generate(prompt_token_ids=[conv], sampling_params=greedy(max_tokens, **kw))[0]
        assert out.token_ids == hf_greedy(hf_model, conv, max_tokens)
        conv += out.token_ids
    return conv


def chats_at_once(llm, hf_model, chats) -> None:
    """`chat` each (system, users) of `chats` on its own thread; a failure in any
    fails the test."""
    with futures.ThreadPoolExecutor(len(chats)) as pool:
        for done in [pool.submit(chat, llm, hf_model, s, u) for s, u in chats]:
            done.result()


def check_pool(llm):
    wait_idle(llm)
    for a in llm.engine.decode_scheduler.allocators:
        a.check()
    assert_all_pages_free(llm)


def start_workers(workers: list, path, router_address, auth, roles) -> None:
    """In-process workers of `roles` ("prefill=1" or "decode=1" meshes, prefix caching
    on, gRPC KV) registered with the router at `router_address` (heartbeat 0.2 s);
    each (llm, server, connector) is appended to `workers` as it starts (the caller
    stops them, started or not)."""
    from jaxpd.serving.role_server import RoleServer, RoleService, make_connector
    for role in roles:
        connector, kv_address = make_connector(role, "grpc", "127.0.0.1", auth)
        llm = LLM(path, mesh=f"{role}=1", max_model_len=192, slots_per_shard=2,
                  connector=connector, enable_prefix_caching=True, warmup=False)
        server = RoleServer(RoleService(llm.engine, kv_address, "grpc"), "127.0.0.1", 0, auth)
        server.start()
        server.register_with(router_address, heartbeat_s=0.2)
        workers.append((llm, server, connector))


def page_bytes(llm) -> int:
    """Bytes one page of k and v takes in transit (float32, uncompressed)."""
    cfg = llm.engine.model.cfg
    return 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4

