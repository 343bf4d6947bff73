"""Asks the kernel to sample with extreme parameters; each must be refused with
InvalidArgument naming the parameter, never an internal error."""
from symphony.lip import kv, pred, send, tokenize
from symphony.lip.errors import InvalidArgument, SyscallError


def main():
    cases = [("temperature", 1e-300), ("temperature", float("nan")), ("temperature", -1.0),
             ("temperature", float("inf")), ("top_p", 0.0), ("top_k", -3), ("seed", "abc"),
             ("min_p", -0.5), ("min_p", float("nan"))]
    with kv.create() as f:
        for name, value in cases:
            try:
                pred(f, tokenize("Hello"), output="sample", **{name: value})
                send(f"{name}={value}: accepted\n")
            except InvalidArgument as e:
                send(f"{name}={value}: InvalidArgument: {e}\n")
            except SyscallError as e:
                send(f"{name}={value}: {type(e).__name__}: {e}\n")
        t = pred(f, tokenize("Hello"), output="sample", temperature=0.7, seed=1)
        send(f"valid sample {t} length {len(f)} prompt {len(tokenize('Hello'))}\n")
