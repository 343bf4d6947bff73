import os


def main():
    os.execv("/bin/sh", ["sh", "-c", "echo pwned"])
