"""The waits of the ``glue.*`` targets (`fuzzlib.t_glue`), one home for both sides: the worker's
wait for the peer's answer, and every wait inside a case (the glue's timeouts), below it so a
stuck exchange answers before the worker gives up on the peer."""

import datetime

#: seconds the worker waits for the peer's answer to a case
ANSWER_S = 45.0
#: every wait inside a case (the glue's ``timeout=``): below ANSWER_S
WAIT = datetime.timedelta(seconds=20)

__all__ = ["ANSWER_S", "WAIT"]
