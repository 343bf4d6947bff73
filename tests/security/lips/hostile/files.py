def main():
    open("/etc/passwd").read()
