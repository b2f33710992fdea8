/* The pod sandbox's process for the real-node tests' container runtime (the pause image, which no
 * registry here provides): holds the pod's namespaces, reaps orphans, exits on SIGTERM or SIGINT.
 * Built with `gcc -static` by scripts/build-images.sh. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction on_stop = {.sa_handler = stop};
    struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
        sigaction(SIGCHLD, &on_child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
