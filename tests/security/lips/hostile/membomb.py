def main():
    hog = []
    while True:
        hog.append(bytearray(64 << 20))
