"""SWARM-style agents: a triage agent hands the conversation to specialists who use tools.

    symphony run userland/swarm.py "What is 37 * 91?"
    symphony run --grant read:/srv/notes userland/swarm.py "What is the codename of project Zephyr?" \\
        "And what is 12 * 12?"            # each argument is one user message, in order
    options: --max-steps N (tool calls in one agent turn, default 3), --max-tokens N (an answer's
             length, default 96), --max-handoffs N (handoffs per user message, default 3),
             --no-cache (compute the team preamble in this run, as if no run came before)

Three agents, each with its own instructions and tools, share one conversation:
  Triage    routes the request: it can only transfer to Research or Math;
  Research  search[words] (lines of the files granted with ``--grant read:DIR``) and
            http[url] (a host granted with ``--grant http:HOST[:PORT]``), then answers;
  Math      calc[expression], then answers.
Research and Math may also hand the conversation to each other or back to Triage; after
--max-handoffs in one user message they must answer.  The tools that touch the world run
on the server through the LIP's capabilities (read_file, list_dir, http).

The KV layout is the point.  The shared conversation (a team preamble, the user's
messages, each agent turn's visible record) is ONE KV file, each token computed once.
An agent's turn forks it (copy-on-write: the conversation's pages are shared), appends
the agent's private instructions in the fork only, and works there: constrained choices
of its next move (a token mask over the move openings: one of its tools, a transfer, or
``answer:``), tool inputs and answers decoded greedily, tool results written in.  At the
end of the turn the fork is closed and the turn's record (moves, results, answer) is
appended to the conversation file.  A handoff therefore recomputes nothing: the next
agent forks the conversation as it stands.  A prompt-serving client (OpenAI Swarm over a
chat API) sends each agent's instructions first and the whole conversation after them,
so every turn recomputes the conversation unless the server's cache holds that exact
prefix; the closing JSON line counts both.

The team preamble (the instructions every agent shares, which open the conversation)
is computed once per kernel and user, not once per run: its KV is a cache file in the
user's private KV directory, /home/<user>/swarm/preamble-<key>.kv (key: a hash of its
tokens and the model's shape), and a run forks the conversation from it.  A cache file
may be deleted by the kernel when KV memory is short and no run has it open; the next
run finds it missing and computes it again (and names it again).  Two runs that both
miss compute it both; the first to name it wins, the other goes on with its own copy.
``--no-cache`` computes the preamble in the run, fed with the first user message.

Sends each turn's record as it ends, then one JSON line: the answers, the turns (agent,
moves, the conversation's length when the turn forked it, tokens fed and decoded in the
fork), the handoffs, ``generated`` (the tokens the model decoded, all turns),
``conversation_tokens`` (the file's length), ``conversation_fed`` (tokens fed to it in this
run), ``fork_fed``, ``tokens_fed`` (all pred input in this run: what the kernel counts for
this LIP),
``conversation_recomputed_without_forks`` (the conversation tokens a per-turn prompt
would have computed again), and the preamble's cost: ``preamble_tokens``,
``preamble_reused`` (the cache file's length as the kernel reports it: tokens not fed),
``preamble_computed`` (fed in this run) and ``preamble_cache`` ("hit"; "created": computed
and kept; "raced": computed while a concurrent run kept it; "ignored": a file there was
not trustworthy; "off": --no-cache) and ``preamble_file`` (the cache file's path).
``conversation_fed`` + ``preamble_reused`` =
``conversation_tokens``: every conversation token was computed once, here or in the run
that made the cache file.
"""
import argparse
import hashlib
import sys
from typing import NamedTuple

from symphony.lip import AlreadyExists, NotFound, SyscallError, info, kv, send, tokenizer
from symphony.lip.agents import Writer, calc, http_get, run_tool, search_files

TOOLS = {"search": search_files, "http": http_get, "calc": calc}


class Agent(NamedTuple):
    name: str
    instructions: str
    tools: tuple = ()
    transfers: tuple = ()
    answers: bool = True


AGENTS = {a.name: a for a in (
    Agent("Triage", "You are Triage: you hand arithmetic to Math and questions about files or web "
          "pages to Research.", transfers=("Research", "Math"), answers=False),
    Agent("Research", "You are Research: you search the files or get the web page the user names, "
          "then answer from what you found.", tools=("search", "http"), transfers=("Math", "Triage")),
    Agent("Math", "You are Math: you compute the user's arithmetic with calc, then answer with the result.",
          tools=("calc",), transfers=("Research", "Triage")),
)}
# The shared preamble: computed once, in the conversation file every turn forks.
TEAM = """A team of agents helps the user. Triage routes requests, Research finds facts in files \
and on web pages, Math computes. Each agent's message starts with its name. Examples:

User: What is 15 * 4 + 2?
Triage: transfer to Math
Math: calc[15 * 4 + 2] -> 62
answer: 62

User: Who wrote the report on Mars?
Triage: transfer to Research
Research: search[report Mars] -> report.txt: The report on Mars was written by Ada Lin.
answer: The report on Mars was written by Ada Lin.

User: What does the page http://example.org:8080/news say?
Triage: transfer to Research
Research: http[http://example.org:8080/news] -> Rain expected tomorrow.
answer: The page says: Rain expected tomorrow."""


def chat_piece(tok, history: list, new: list, opening: bool) -> str:
    """The chat template's text for the messages ``new`` after ``history`` (and the
    assistant's opening when ``opening``): the rendering of both minus that of
    ``history``, so the pieces appended one by one add up to the whole rendering."""
    before = tok.apply_chat_template(history, add_generation_prompt=False) if history else ""
    after = tok.apply_chat_template(history + new, add_generation_prompt=opening)
    if not after.startswith(before):
        raise RuntimeError("the chat template does not render a conversation by appending turns")
    return after[len(before):]


def parse(args):
    p = argparse.ArgumentParser(prog="swarm.py", description="SWARM-style agents with handoffs.")
    p.add_argument("messages", nargs="+", help="the user's messages, in order")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-handoffs", type=int, default=3)
    p.add_argument("--no-cache", action="store_true",
                   help="compute the team preamble in this run instead of forking the user's cache file")
    a = p.parse_args(args)
    if not 0 <= a.max_steps <= 8 or not 1 <= a.max_tokens <= 512 or not 0 <= a.max_handoffs <= 8:
        p.error("--max-steps in [0, 8], --max-tokens in [1, 512], --max-handoffs in [0, 8]")
    return a


def warn(msg: str) -> None:
    print(f"swarm: {msg}", file=sys.stderr, flush=True)


def start_conversation(tok, text: str, cache: bool):
    """The conversation file and its Writer, the team preamble ``text`` in it, and what
    the preamble cost: {"preamble_tokens", "preamble_reused", "preamble_computed",
    "preamble_cache" ("off", "hit", "created", "raced" or "ignored"), "preamble_file"}.

    With ``cache``, the preamble's KV is the file ``/home/<user>/swarm/preamble-<key>.kv``
    (key: a hash of the preamble's tokens and the model's shape).  A trustworthy one
    (the user's own, writable by nobody else, exactly the preamble's tokens) is forked,
    copy-on-write, and nothing of the preamble is fed.  Otherwise the preamble is
    computed in an anonymous file, which is then named (a fork: the pages are shared)
    and advised "cache", so the kernel may delete it under memory pressure while no run
    has it open; a concurrent run that named it first wins (AlreadyExists, "raced"),
    and a missing or dropped file is simply computed again.  Without ``cache`` the
    preamble is pending in the Writer and fed with the first user message."""
    ids = tok.encode(text)
    stats = {"preamble_tokens": len(ids), "preamble_reused": 0, "preamble_computed": len(ids),
             "preamble_cache": "off", "preamble_file": None}
    if not cache:
        conv = kv.create()
        return conv, Writer(conv, tok, text), stats
    shape = info()
    me = shape["user"]
    key = hashlib.sha256(repr((ids, shape["vocab_size"], shape["max_context"])).encode()).hexdigest()[:20]
    folder = f"/home/{me}/swarm"
    path = stats["preamble_file"] = f"{folder}/preamble-{key}.kv"
    named = True
    try:
        kv.mkdir(folder)                                     # private (0700)
    except AlreadyExists:
        pass
    except SyscallError as e:
        warn(f"no cache: {e}")
        named = False
    if named:
        try:
            cached = kv.open(path)
        except NotFound:                                      # never made, or dropped: compute it
            cached = None
        except SyscallError as e:
            warn(f"ignoring {path}: {e}")
            cached, named = None, False
        if cached is not None:
            with cached:
                st = cached.stat()                            # the file this handle holds
                if (st["owner"] == me and not st["mode"] & 0o022 and st["length"] == len(ids)
                        and st["next_position"] == len(ids)):
                    conv = cached.fork()                      # copy-on-write: nothing computed
                    stats.update(preamble_reused=st["length"], preamble_computed=0, preamble_cache="hit")
                    return conv, Writer(conv, tok), stats
                warn(f"ignoring {path}: owner {st['owner']}, mode {st['mode']:o}, {st['length']} tokens "
                     f"(expected {me}, writable only by its owner, {len(ids)}); computing the preamble")
            named, stats["preamble_cache"] = False, "ignored"
    conv = kv.create()
    cw = Writer(conv, tok, text)
    cw.flush()
    if named:
        try:
            with conv.fork(path) as kept:                     # named: shares conv's pages
                kept.advise("cache")
            stats["preamble_cache"] = "created"
        except AlreadyExists:                                 # a concurrent run named it first
            stats["preamble_cache"] = "raced"
        except SyscallError as e:                             # e.g. the quota: run without it
            warn(f"cannot keep {path}: {e}")
    return conv, cw, stats


def take_turn(agent: Agent, conv, tok, history: list, o, may_transfer: bool):
    """One agent's turn on a fork of the conversation: (moves, transfer target or None,
    answer or None, the fork's Writer: what it fed and decoded)."""
    private = chat_piece(tok, history, [{"role": "system", "content": agent.instructions}], True)
    with conv.fork() as f:
        w = Writer(f, tok, private + f"{agent.name}: ")
        moves = []
        for step in range(o.max_steps + 1):
            options = [f"{t}[" for t in agent.tools] if step < o.max_steps else []
            if may_transfer or not agent.answers:
                options += [f"transfer to {x}" for x in agent.transfers]
            options += ["answer:"] if agent.answers else []
            move = w.choose(options)
            if move.startswith("transfer to "):
                moves.append(move)
                return moves, move[len("transfer to "):], None, w
            if move == "answer:":
                answer = w.until("\n", o.max_tokens).strip()
                moves.append(f"answer: {answer}")
                return moves, None, answer, w
            tool = move[:-1]
            arg = w.until("]\n", 64, close="]").strip()
            result = run_tool(TOOLS, tool, arg)
            moves.append(f"{tool}[{arg}] -> {result}")
            w.write(f" -> {result}\n")
        raise AssertionError("unreachable: the last step offers no tool")


def main(*args):
    o = parse(args)
    tok = tokenizer()
    history = [{"role": "system", "content": TEAM}]
    conv, cw, preamble = start_conversation(tok, chat_piece(tok, [], history, False), not o.no_cache)
    with conv:
        answers, turns, handoffs, recomputable = [], [], [], 0
        for message in o.messages:
            user = [{"role": "user", "content": message}]
            cw.write(chat_piece(tok, history, user, False))
            history += user
            agent, handed = AGENTS["Triage"], 0
            while True:
                cw.flush()                                   # the conversation as it stands
                recomputable += len(conv)
                moves, target, answer, w = take_turn(agent, conv, tok, history, o,
                                                     may_transfer=handed < o.max_handoffs)
                turns.append({"agent": agent.name, "moves": moves, "conversation_len": len(conv),
                              "fed": w.fed, "generated": w.generated})
                record = [{"role": "assistant", "content": f"{agent.name}: " + "\n".join(moves)}]
                cw.write(chat_piece(tok, history, record, False))
                history += record
                send(f"[{agent.name}] " + "\n".join(moves) + "\n")
                if target is None:
                    answers.append(answer)
                    break
                handoffs.append([agent.name, target])
                agent, handed = AGENTS[target], handed + 1
        cw.flush()
        fork_fed = sum(t["fed"] for t in turns)
        send({"answers": answers, "turns": turns, "handoffs": handoffs,
              "conversation_tokens": len(conv), "conversation_fed": cw.fed, "fork_fed": fork_fed,
              "tokens_fed": cw.fed + fork_fed, "conversation_recomputed_without_forks": recomputable,
              "generated": sum(t["generated"] for t in turns),
              **preamble})
