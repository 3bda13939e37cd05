"""Structured outputs: grammars that decide which tokens a request may sample next.

    backend.py            the interface a grammar library implements (compile, match, mask)
    xgrammar_backend.py   the one implementation, over xgrammar (vLLM's and SGLang's choice)
    manager.py            the engine's side: grammars compiled once per spec and cached, a
                          matcher per constrained sequence, the step's `GrammarBitmask`, and
                          each sampled token fed back

The engine owns the matchers (host state, advanced by the tokens it receives); the worker's
sampler only applies the masks it is handed (`fastgen.worker.token_bitmask`).
"""
