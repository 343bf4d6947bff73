import time


def main():
    time.sleep(3600)
