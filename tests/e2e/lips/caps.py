"""Uses the read_file / list_dir / http capabilities as granted."""
from symphony.lip import http, list_dir, read_file, send, errors


def main(directory, url):
    send({"list": list_dir(directory)})
    send({"read": read_file(directory + "/notes.txt")})
    try:
        read_file(directory + "/../outside.txt")
        send("escaped!\n")
    except errors.PermissionDenied:
        send("outside refused\n")
    r = http(url)
    send({"http": r["status"], "body": r["body"]})
