"""The training task: prompt data and templates (`data`), the rewards and their answer check (`rewards`, and the
child process that runs math-verify, `answer_worker`)."""
