def main():
    while True:
        pass
