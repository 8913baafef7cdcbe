def add_parser(commands):
    commands.add_parser("doctor", help="(coming)")


def run(args):
    return 0
