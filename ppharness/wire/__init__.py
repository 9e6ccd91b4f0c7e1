"""What crosses a process boundary: the message types and their binary framing."""
